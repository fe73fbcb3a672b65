//! Files the binaries write where others may write too, such as a `--pid-file` in /run or a
//! shared /tmp subdirectory. They often run as root, so nothing may be written through a
//! symlink someone planted: the content goes into a new file of an unpredictable name,
//! created with O_EXCL and O_NOFOLLOW, which is then renamed over the path (a rename
//! replaces a symlink there instead of following it).

use std::collections::hash_map::RandomState;
use std::fs::OpenOptions;
use std::hash::BuildHasher;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// How many names to try when the temporary name exists already (only someone racing us
/// could make more than one fail).
const ATTEMPTS: u32 = 16;

/// Writes `contents` to `path` as a new file, mode 0644 (less the umask), replacing whatever
/// is at `path` (a file, or a symlink, which is not followed). A reader sees the old file or
/// the whole new one, never a part.
pub fn replace_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    let (tmp, mut file) = create_beside(path)?;
    let written = file
        .write_all(contents)
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes this process's id and a newline to `path`, as [`replace_file`] does.
pub fn write_pid_file(path: &Path) -> io::Result<()> {
    replace_file(path, format!("{}\n", std::process::id()).as_bytes())
}

/// A new file in `path`'s directory, named after it with a random suffix.
fn create_beside(path: &Path) -> io::Result<(PathBuf, std::fs::File)> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    for _ in 0..ATTEMPTS {
        // RandomState is keyed from the OS's random source: the name cannot be guessed.
        let suffix = RandomState::new().hash_one(std::process::id());
        let mut tmp_name = name.to_os_string();
        tmp_name.push(format!(".tmp-{suffix:016x}"));
        let tmp = path.with_file_name(tmp_name);
        match OpenOptions::new()
            .write(true)
            .create_new(true) // O_CREAT | O_EXCL
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(0o644)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("{ATTEMPTS} temporary names beside it were all taken"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn writes_a_new_file_and_leaves_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.pid");
        write_pid_file(&p).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{}\n", std::process::id())
        );
        replace_file(&p, b"again\n").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "again\n");
        let meta = std::fs::symlink_metadata(&p).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o022, 0, "group/other writable");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn a_symlink_at_the_path_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let p = dir.path().join("x.pid");
        std::os::unix::fs::symlink(&victim, &p).unwrap();
        replace_file(&p, b"1\n").unwrap();
        assert!(std::fs::symlink_metadata(&p).unwrap().is_file());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "1\n");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }

    #[test]
    fn a_failed_rename_removes_the_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("taken");
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("inside"), "").unwrap();
        assert!(replace_file(&p, b"1\n").is_err());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["taken"]);
    }
}
