//! Mounts for `nbd ext2` (root): a FUSE client that stands an NBD export up as a file, a loop
//! device on that file, and the ext2 file system on the loop device. Each is undone by its
//! guard (unmounted, detached, stopped), also when a round fails.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::peers::{EXPORT, Running, die_with_parent};

const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Which program is the FUSE client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FuseProgram {
    /// qpip-nbd-mount (over QPs): mounts a directory holding the export's file.
    QpipMount,
    /// qemu-storage-daemon's FUSE export (over a TCP socket): mounts on a file.
    QemuStorageDaemon,
}

impl FuseProgram {
    pub(crate) fn name(self) -> &'static str {
        match self {
            FuseProgram::QpipMount => "qpip-nbd-mount",
            FuseProgram::QemuStorageDaemon => "qemu-storage-daemon",
        }
    }
}

pub(crate) fn run(prog: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {prog}"))?;
    if !out.status.success() {
        bail!(
            "{prog} {} failed with {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Mount points of the machine (field 5 of /proc/self/mountinfo, octal escapes undone).
pub(crate) fn mount_points() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| {
            PathBuf::from(
                m.replace("\\040", " ")
                    .replace("\\011", "\t")
                    .replace("\\012", "\n")
                    .replace("\\134", "\\"),
            )
        })
        .collect()
}

fn is_mountpoint(p: &Path) -> bool {
    mount_points().iter().any(|m| m == p)
}

pub(crate) fn drop_caches() -> Result<()> {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("writing /proc/sys/vm/drop_caches")
}

/// A FUSE client: qpip-nbd-mount on a directory, or qemu-storage-daemon on a file.
pub(crate) struct FuseClient {
    program: FuseProgram,
    child: Child,
    /// What is mounted: the directory (qpip-nbd-mount) or the file (qemu-storage-daemon).
    mount: PathBuf,
    /// The file that stands for the export.
    pub device: PathBuf,
    log: PathBuf,
}

impl FuseClient {
    /// Starts `program` on `server`'s export in `dir` (its log: `dir/LABEL-client.log`) and
    /// waits until the export's file is there.
    pub(crate) fn start(
        program: FuseProgram,
        label: &str,
        server: &Running,
        mount: (&Path, &[String]),
        dir: &Path,
    ) -> Result<FuseClient> {
        let (mount_bin, mount_args) = mount;
        let log = dir.join(format!("{label}-client.log"));
        let logf = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let (mut cmd, mount, device) = if program == FuseProgram::QpipMount {
            let mnt = dir.join("fuse");
            std::fs::create_dir_all(&mnt)?;
            let mut c = Command::new(mount_bin);
            c.args(mount_args).arg(server.uri()).arg(&mnt);
            let dev = mnt.join(EXPORT);
            (c, mnt, dev)
        } else {
            let file = dir.join("fuse-file");
            File::create(&file).with_context(|| format!("creating {}", file.display()))?;
            let (host, port) = (server.addr().ip(), server.addr().port());
            let mut c = Command::new("qemu-storage-daemon");
            c.arg("--blockdev")
                .arg(format!(
                    "driver=nbd,node-name=n,server.type=inet,server.host={host},\
                     server.port={port},export={EXPORT}"
                ))
                .arg("--export")
                .arg(format!(
                    "type=fuse,id=e,node-name=n,mountpoint={},writable=on",
                    file.display()
                ));
            (c, file.clone(), file)
        };
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(logf.try_clone()?))
            .stderr(logf)
            .process_group(0);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", program.name()))?;
        let mut c = FuseClient {
            program,
            child,
            mount,
            device,
            log,
        };
        let t0 = Instant::now();
        loop {
            if let Some(status) = c.child.try_wait()? {
                bail!(
                    "{} exited with {status} before mounting {}:\n{}",
                    program.name(),
                    c.mount.display(),
                    std::fs::read_to_string(&c.log).unwrap_or_default().trim()
                );
            }
            if is_mountpoint(&c.mount) && c.device.exists() {
                return Ok(c);
            }
            if t0.elapsed() > MOUNT_TIMEOUT {
                bail!(
                    "{} did not mount {} within {MOUNT_TIMEOUT:?}:\n{}",
                    program.name(),
                    c.mount.display(),
                    std::fs::read_to_string(&c.log).unwrap_or_default().trim()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Unmounts (lazily if it is still busy) and stops the process.
    pub(crate) fn stop(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        if is_mountpoint(&self.mount) {
            let m = self.mount.to_string_lossy().into_owned();
            if let Err(e) = run("fusermount3", &["-u", &m]) {
                errors.push(format!("{e:#}"));
                let _ = run("fusermount3", &["-u", "-z", &m]);
            }
        }
        if self.child.try_wait()?.is_none() {
            // qpip-nbd-mount exits once unmounted; qemu-storage-daemon needs the signal.
            let t0 = Instant::now();
            while self.program == FuseProgram::QpipMount
                && t0.elapsed() < Duration::from_secs(2)
                && self.child.try_wait()?.is_none()
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: kill with the pid of our unreaped child.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
            let t0 = Instant::now();
            while self.child.try_wait()?.is_none() {
                if t0.elapsed() > STOP_TIMEOUT {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    errors.push(format!(
                        "{} ignored SIGTERM for {STOP_TIMEOUT:?}; killed",
                        self.program.name()
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("; "));
        }
        Ok(())
    }
}

impl Drop for FuseClient {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("qpip-bench: stopping {}: {e:#}", self.program.name());
        }
    }
}

/// A loop device on a file, detached on drop.
pub(crate) struct LoopDev {
    dev: Option<String>,
    /// Whether the device really runs with direct I/O (it may fall back to buffered).
    pub direct_io: bool,
}

impl LoopDev {
    pub(crate) fn attach(file: &Path, direct_io: bool) -> Result<LoopDev> {
        let f = file.to_string_lossy();
        let dio = if direct_io {
            "--direct-io=on"
        } else {
            "--direct-io=off"
        };
        let dev = run("losetup", &["-f", "--show", dio, &f])?;
        let mut l = LoopDev {
            dev: Some(dev),
            direct_io: false,
        };
        let dio = run("losetup", &["-n", "-O", "DIO", "-l", l.path()])?;
        l.direct_io = dio.trim() == "1";
        Ok(l)
    }

    pub(crate) fn path(&self) -> &str {
        self.dev.as_deref().unwrap_or("")
    }

    pub(crate) fn detach(&mut self) -> Result<()> {
        let Some(dev) = self.dev.take() else {
            return Ok(());
        };
        // The kernel may still hold it for a moment after an unmount.
        let mut last = None;
        for _ in 0..50 {
            match run("losetup", &["-d", &dev]) {
                Ok(_) => return Ok(()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last.expect("at least one try"))
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        if let Err(e) = self.detach() {
            eprintln!("qpip-bench nbd ext2: {e:#}");
        }
    }
}

/// The mounted ext2 file system; unmounted (lazily if busy) on drop.
pub(crate) struct ExtMount {
    path: PathBuf,
    mounted: bool,
}

impl ExtMount {
    pub(crate) fn mount(dev: &str, path: &Path) -> Result<ExtMount> {
        std::fs::create_dir_all(path)?;
        run("mount", &["-t", "ext2", dev, &path.to_string_lossy()])?;
        Ok(ExtMount {
            path: path.to_path_buf(),
            mounted: true,
        })
    }

    pub(crate) fn unmount(&mut self) -> Result<()> {
        if self.mounted {
            self.mounted = false;
            let p = self.path.to_string_lossy().into_owned();
            if let Err(e) = run("umount", &[&p]) {
                let _ = run("umount", &["-l", &p]);
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Drop for ExtMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            eprintln!("qpip-bench nbd ext2: {e:#}");
        }
    }
}
