//! The server driven from scripts and service managers, as nbdkit and qemu-nbd users do:
//! captive mode (`--run`), `--fork` with `--pid-file`, `--exit-with-parent`, and systemd
//! socket activation (LISTEN_PID/LISTEN_FDS).

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

fn wait_gone(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if !pid_alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn read_pid(path: &Path) -> i32 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn run_gives_the_command_a_uri_and_exits_with_its_status() {
    if !require(&["qemu-io", "qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.img", 8 << 20);
    let out_file = dir.path().join("out");
    let script = format!(
        "qemu-io -f raw \"$uri\" -c 'write -P 0x77 1M 64k' >/dev/null && qemu-img info -f raw \"$nbd\" > {} && test -n \"$port\" && exit 7",
        out_file.display()
    );
    let out = run_with_timeout(
        Command::new(BIN).args([
            "--export",
            &format!("d={}", img.display()),
            "--run",
            &script,
        ]),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    let info = std::fs::read_to_string(&out_file).unwrap();
    assert!(info.contains("virtual size: 8 MiB"), "{info}");
    let data = std::fs::read(&img).unwrap();
    assert!(data[1 << 20..(1 << 20) + 65536].iter().all(|&b| b == 0x77));
    // A command that fails to start its work: its status, not 0.
    let out = run_with_timeout(
        Command::new(BIN).args([
            "--export",
            &format!("d={}", img.display()),
            "--run",
            "exit 3",
        ]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
}

#[test]
fn run_leaves_stdout_to_the_command() {
    // Issue 25 item 3: `--run 'nbdcopy "$uri" -' > disk.raw` must write the image's bytes
    // only; status lines ("listening on ...") go to stderr, and -q silences them.
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.img", 4 << 20);
    for quiet in [false, true] {
        let mut cmd = Command::new(BIN);
        if quiet {
            cmd.arg("-q");
        }
        cmd.args(["--export", &format!("d={}", img.display())])
            .args(["--run", "cat /dev/null"]);
        let out = run_with_timeout(&mut cmd, Duration::from_secs(30));
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            out.stdout.is_empty(),
            "stdout not empty: {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            stderr.contains("listening on"),
            !quiet,
            "-q: {quiet}; stderr: {stderr}"
        );
    }
    if !require(&["nbdcopy"]) {
        return;
    }
    let want = qpip_test_support::pattern::at_offset(0, 4 << 20);
    std::fs::write(&img, &want).unwrap();
    let out = run_with_timeout(
        Command::new(BIN).args([
            "--export",
            &format!("d={}", img.display()),
            "--run",
            "nbdcopy \"$uri\" -",
        ]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(out.stdout == want, "stdout is not the image's bytes");
}

#[test]
fn fork_returns_when_serving_and_the_pid_file_names_the_server() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.img", 4 << 20);
    let pid_file = dir.path().join("server.pid");
    // stdout and stderr are pipes here, as in `$(...)`: the command must still return.
    let out = run_with_timeout(
        Command::new(BIN).args([
            "--fork",
            "--pid-file",
            pid_file.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--export",
            &format!("d={}", img.display()),
        ]),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // The status line is on stderr; stdout stays the user's.
    assert!(out.stdout.is_empty(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let addr = stderr
        .lines()
        .find_map(|l| l.strip_prefix("qpip-nbd-server: listening on "))
        .unwrap_or_else(|| panic!("no address in {stderr}"))
        .to_string();
    let pid = read_pid(&pid_file);
    assert!(pid_alive(pid));
    let info =
        peer_ok(Command::new("qemu-img").args(["info", "-f", "raw", &format!("nbd://{addr}/d")]));
    assert!(info.contains("virtual size: 4 MiB"), "{info}");
    // SAFETY: kill(2) on the server we started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(
        wait_gone(pid, Duration::from_secs(20)),
        "the server ignored SIGTERM"
    );
    assert!(!pid_file.exists(), "the pid file outlived the server");

    // A server that fails before it serves: the command fails with its error.
    let out = run_with_timeout(
        Command::new(BIN)
            .args(["--fork", "--listen", "127.0.0.1:0", "--export"])
            .arg(format!("d={}", dir.path().join("missing.img").display())),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing.img"), "{err}");
}

#[test]
fn exit_with_parent_shuts_down_when_the_parent_exits() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("server.pid");
    // The parent: a shell that starts the server, waits until it serves, then exits.
    let script = format!(
        "\"$0\" --exit-with-parent --pid-file {p} --listen 127.0.0.1:0 >/dev/null 2>&1 &\n\
         for i in $(seq 100); do [ -s {p} ] && exit 0; sleep 0.1; done; exit 1",
        p = pid_file.display()
    );
    let st = Command::new("sh")
        .args(["-c", &script, BIN])
        .status()
        .unwrap();
    assert!(st.success(), "the server did not start");
    let pid = read_pid(&pid_file);
    assert!(
        wait_gone(pid, Duration::from_secs(20)),
        "the server outlived its parent"
    );
}

#[test]
fn socket_activation_serves_on_the_passed_socket() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.img", 2 << 20);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fd = listener.as_raw_fd();
    // As systemd does: the socket at fd 3, LISTEN_PID the server's own pid (the shell
    // execs it, keeping its pid).
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" \"$@\"",
        BIN,
        "--export",
        &format!("d={}", img.display()),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    // SAFETY: dup2 between fork and exec, async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            // dup2 onto itself would keep close-on-exec: clear it then.
            let r = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    drop(listener); // the server owns it now
    let uri = format!("nbd://{addr}/d");
    let mut info = String::new();
    for _ in 0..100 {
        let o = Command::new("qemu-img")
            .args(["info", "-f", "raw", &uri])
            .output()
            .unwrap();
        info = text(&o);
        if o.status.success() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert!(info.contains("virtual size: 2 MiB"), "{info}");
    assert!(st.success(), "{st}");

    // With --listen as well: refused, one line.
    let out = run_with_timeout(
        Command::new("sh").args([
            "-c",
            "LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" --listen 127.0.0.1:0",
            BIN,
        ]),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("socket activation"), "{}", text(&out));
}

/// A world-writable directory for a pid file (as /run/user or a shared /tmp subdirectory can
/// be), and outside it a victim file an attacker wants root to overwrite.
fn hostile_dir() -> (tempfile::TempDir, tempfile::TempDir, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let safe = tempfile::tempdir().unwrap();
    let victim = safe.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    (dir, safe, victim)
}

/// Starts the server (the demo export) with `--pid-file pid_file`, running `plant` in the
/// child before exec with the child's (so the server's) pid; waits for the pid file.
fn server_with_pid_file(
    pid_file: &Path,
    mut plant: impl FnMut(i32) + Send + Sync + 'static,
) -> Child {
    let mut cmd = Command::new(BIN);
    cmd.args(["--listen", "127.0.0.1:0", "--pid-file"])
        .arg(pid_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: `plant` makes only system calls on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            plant(libc::getpid());
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Until it holds a pid (what a symlink planted there points at does not parse).
    while !std::fs::read_to_string(pid_file)
        .is_ok_and(|s| s.ends_with('\n') && s.trim().parse::<i32>().is_ok())
    {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the server exited ({st}) before writing its pid file");
        }
        assert!(Instant::now() < deadline, "no pid file");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn stop(mut child: Child) {
    // SAFETY: kill(2) on our child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}

/// An attacker who can write the pid file's directory cannot make the server (root) write
/// through a symlink planted at the name of its temporary file. The old server wrote
/// `NAME.tmp<PID>` (the pid file's extension replaced), predictable from its pid: the
/// symlink here is planted at exactly that name, in the child before exec.
#[test]
fn pid_file_is_not_written_through_a_symlink_at_a_guessable_temporary_name() {
    use std::os::unix::ffi::OsStrExt;
    let (dir, _safe, victim) = hostile_dir();
    let pid_file = dir.path().join("server.pid");
    // Prepared before the fork: the child only writes digits into this buffer (no allocation).
    let mut prefix = pid_file
        .with_extension("tmp")
        .as_os_str()
        .as_bytes()
        .to_vec();
    prefix.resize(prefix.len() + 12, 0);
    let prefix_len = prefix.len() - 12;
    let target = std::ffi::CString::new(victim.as_os_str().as_bytes()).unwrap();
    let child = server_with_pid_file(&pid_file, move |pid| {
        let mut digits = [0u8; 10];
        let (mut n, mut i) = (pid as u32, digits.len());
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        prefix[prefix_len..prefix_len + digits.len() - i].copy_from_slice(&digits[i..]);
        // SAFETY: both are NUL-terminated (the buffer has zeroes past the digits).
        unsafe { libc::symlink(target.as_ptr(), prefix.as_ptr().cast()) };
    });
    let pid = child.id() as i32;
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "precious\n",
        "the server wrote through the planted symlink"
    );
    assert!(std::fs::symlink_metadata(&pid_file).unwrap().is_file());
    assert_eq!(read_pid(&pid_file), pid);
    stop(child);
    assert!(!pid_file.exists(), "the pid file outlived the server");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
}

/// A symlink at the pid file's path is replaced by the pid file, not followed.
#[test]
fn a_symlink_at_the_pid_file_path_is_replaced_not_followed() {
    let (dir, _safe, victim) = hostile_dir();
    let pid_file = dir.path().join("server.pid");
    std::os::unix::fs::symlink(&victim, &pid_file).unwrap();
    let child = server_with_pid_file(&pid_file, |_| {});
    let pid = child.id() as i32;
    assert!(std::fs::symlink_metadata(&pid_file).unwrap().is_file());
    assert_eq!(read_pid(&pid_file), pid);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    stop(child);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
