//! The work directory of a run and the images in it, each removed by its guard. A signal
//! ends the process without running guards, so `nbd raw` (whose images are GiBs on disk)
//! also cleans up from a signal watcher; the others live on tmpfs and use `stats::Interrupt`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The directory holding a run's files; a directory we created is removed on drop.
pub(crate) struct WorkDir {
    pub path: PathBuf,
    created: bool,
}

impl WorkDir {
    /// `dir` as given (kept on drop), or a fresh `qpip-bench-NAME-PID` in the temporary
    /// directory (removed on drop).
    pub(crate) fn new(dir: Option<&Path>, name: &str) -> Result<WorkDir> {
        match dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                Ok(WorkDir {
                    path: d.to_path_buf(),
                    created: false,
                })
            }
            None => WorkDir::created(std::env::temp_dir().join(run_dir_name(name))),
        }
    }

    /// `dir`, or a fresh `qpip-bench-NAME-PID` on tmpfs (/dev/shm) if there is one, else in
    /// the temporary directory; removed on drop either way.
    pub(crate) fn on_tmpfs(dir: Option<&Path>, name: &str) -> Result<WorkDir> {
        let path = dir.map(Path::to_path_buf).unwrap_or_else(|| {
            let shm = Path::new("/dev/shm");
            let root = if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            };
            root.join(run_dir_name(name))
        });
        WorkDir::created(path)
    }

    /// A fresh `qpip-bench-NAME-PID` inside `root` (default: tmpfs, /dev/shm, if there is
    /// one, else the temporary directory); removed on drop, `root` itself left alone.
    pub(crate) fn fresh_in(root: Option<&Path>, name: &str) -> Result<WorkDir> {
        let root = root.map(Path::to_path_buf).unwrap_or_else(|| {
            let shm = Path::new("/dev/shm");
            if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            }
        });
        WorkDir::created(root.join(run_dir_name(name)))
    }

    /// Creates `path` (and its parents), removed on drop.
    pub(crate) fn created(path: PathBuf) -> Result<WorkDir> {
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(WorkDir {
            path,
            created: true,
        })
    }

    /// Interrupted (SIGINT, SIGTERM, SIGHUP): Drop guards do not run when a signal ends the
    /// process, so a watcher thread deletes the directory (or, in a directory we did not
    /// create, the `files` in it) and `--netns`'s namespace and exits with `note`. Child processes get SIGTERM from the
    /// kernel when we die (`peers::die_with_parent`).
    pub(crate) fn clean_up_on_signals(&self, files: Vec<String>, note: &'static str) -> Result<()> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
            .context("installing signal handlers")?;
        let (path, created) = (self.path.clone(), self.created);
        std::thread::spawn(move || {
            if let Some(sig) = signals.forever().next() {
                if created {
                    let _ = std::fs::remove_dir_all(&path);
                } else {
                    for f in &files {
                        let _ = std::fs::remove_file(path.join(f));
                    }
                }
                super::netns::remove_active();
                eprintln!("{note}");
                std::process::exit(128 + sig);
            }
        });
        Ok(())
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.created {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn run_dir_name(name: &str) -> String {
    format!("qpip-bench-{name}-{}", std::process::id())
}

/// An image file, deleted on drop.
pub(crate) struct Image {
    pub path: PathBuf,
}

impl Image {
    /// A fresh sparse image of `size` bytes (any old file there is replaced).
    pub(crate) fn sparse(path: PathBuf, size: u64) -> Result<Image> {
        let _ = std::fs::remove_file(&path);
        let f = std::fs::File::create_new(&path)
            .with_context(|| format!("creating image {}", path.display()))?;
        f.set_len(size)
            .with_context(|| format!("sizing image {} to {size} bytes", path.display()))?;
        Ok(Image { path })
    }

    /// An image of `size` bytes of `byte` (not zero: reads never hit holes).
    pub(crate) fn filled(path: PathBuf, size: u64, byte: u8) -> Result<Image> {
        let img = Image { path };
        let mut f = std::fs::File::create(&img.path)
            .with_context(|| format!("creating {}", img.path.display()))?;
        let buf = vec![byte; 1 << 20];
        let mut left = size;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            f.write_all(&buf[..n])?;
            left -= n as u64;
        }
        Ok(img)
    }

    /// An image of `size` bytes of pseudo-random data (xorshift64* from `seed`): nothing a
    /// store or a link could compress or skip as zeroes.
    pub(crate) fn random(path: PathBuf, size: u64, seed: u64) -> Result<Image> {
        let img = Image { path };
        let mut f = std::fs::File::create(&img.path)
            .with_context(|| format!("creating {}", img.path.display()))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut x = seed | 1;
        let mut left = size;
        while left > 0 {
            for word in buf.chunks_exact_mut(8) {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                word.copy_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
            }
            let n = left.min(buf.len() as u64) as usize;
            f.write_all(&buf[..n])
                .with_context(|| format!("writing {}", img.path.display()))?;
            left -= n as u64;
        }
        Ok(img)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_images_have_their_size_and_no_repeated_blocks() {
        let dir = WorkDir::fresh_in(Some(&std::env::temp_dir()), "workdir-test").unwrap();
        let path = dir.path.join("r.img");
        let size = (3 << 20) + 4096;
        let img = Image::random(path.clone(), size, 7).unwrap();
        let data = std::fs::read(&path).unwrap();
        assert_eq!(data.len() as u64, size);
        let blocks: std::collections::HashSet<&[u8]> = data.chunks(4096).collect();
        assert_eq!(blocks.len(), data.len() / 4096);
        drop(img);
        assert!(!path.exists());
        let root = dir.path.clone();
        drop(dir);
        assert!(!root.exists() && std::env::temp_dir().is_dir());
    }
}
