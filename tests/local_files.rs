//! Locked-down local files (issue 25): the data directory is 0700 and every
//! state file 0600; a symbolic link or another user's file at a state path
//! is refused at start, naming it, and left as it is; the admin socket is
//! 0600, answers only its own uid or root (SO_PEERCRED, checked with a
//! client really running as uid 65534), and replaces only a stale socket.
//!
//! The tests run as root, as the suite does: "another user" is the real
//! uid 65534 (`nobody`), given files with chown and a client with setuid.

mod common;

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{Server, qemu_io};

/// The uid (and gid) of `nobody`: a real other user.
const OTHER_UID: u32 = 65534;

fn mode_of(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The data directory of `server` (`--data-dir`).
fn data_dir(server: &Server) -> PathBuf {
    server.dir.path().join("data")
}

/// A start with the server's flags that must be refused: its stderr.
fn refused(server: &Server) -> String {
    let (ok, stderr) = server.start_refused();
    assert!(!ok, "start should have been refused:\n{stderr}");
    stderr
}

#[test]
fn serve_makes_the_data_dir_0700_and_every_state_file_0600() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("rebound.log");
    let server = Server::start(
        "32M",
        &[
            "--devices",
            "3",
            "--raid",
            "parity",
            "--output-commit",
            "renaming",
            "--log-file",
            log.to_str().unwrap(),
        ],
    );
    qemu_io(
        &["-f", "raw", &server.uri()],
        &["write -P 7 0 256k".into(), "flush".into()],
    );
    let data = data_dir(&server);
    assert_eq!(mode_of(&data), 0o700, "the data directory");
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&data).unwrap() {
        let path = entry.unwrap().path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if meta.file_type().is_socket() {
            assert_eq!(name, "admin.sock");
        } else {
            assert!(meta.is_file(), "{name} is a regular file");
        }
        assert_eq!(mode_of(&path), 0o600, "{name}");
        seen.push(name);
    }
    seen.sort();
    for expected in [
        "admin.sock",
        "device0.img",
        "device2.img",
        "output-commit.map",
        "output-commit.rename",
        "ppl.log",
        "volume.toml",
    ] {
        assert!(seen.iter().any(|n| n == expected), "{expected} in {seen:?}");
    }
    for path in [&server.nvs, &server.rbox, &log] {
        assert_eq!(mode_of(path), 0o600, "{}", path.display());
    }
}

#[test]
fn a_symlink_at_the_nvs_box_or_a_device_path_is_refused_naming_it_and_its_target_untouched() {
    let mut server = Server::start("16M", &[]);
    server.stop();
    let device = data_dir(&server).join("device0.img");
    for path in [server.nvs.clone(), server.rbox.clone(), device] {
        // The real file moves aside and becomes the link's target: a
        // server that followed the link would write into it.
        let target = PathBuf::from(format!("{}.target", path.display()));
        std::fs::rename(&path, &target).unwrap();
        chmod(&target, 0o644);
        let before = std::fs::read(&target).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let stderr = refused(&server);
        assert!(
            stderr.contains(&format!(
                "{} is a symbolic link; refusing to follow it",
                path.display()
            )),
            "{}: {stderr}",
            path.display()
        );
        assert!(
            std::fs::read(&target).unwrap() == before,
            "{} target's bytes",
            path.display()
        );
        assert_eq!(mode_of(&target), 0o644, "{} target's mode", path.display());
        assert!(std::fs::symlink_metadata(&path).unwrap().is_symlink());
        std::fs::remove_file(&path).unwrap();
        std::fs::rename(&target, &path).unwrap();
        chmod(&path, 0o600);
    }
    server.restart();
    server
        .admin("status")
        .expect("starts again with the real files");
}

#[test]
fn a_state_file_owned_by_another_user_is_refused_naming_it() {
    let mut server = Server::start("16M", &[]);
    server.stop();
    let data = data_dir(&server);
    for path in [
        server.nvs.clone(),
        data.join("volume.toml"),
        data.join("device0.img"),
    ] {
        let before = std::fs::read(&path).unwrap();
        std::os::unix::fs::chown(&path, Some(OTHER_UID), Some(OTHER_UID)).unwrap();
        let stderr = refused(&server);
        assert!(
            stderr.contains(&format!(
                "{} is owned by uid {OTHER_UID}, not by this server's uid 0",
                path.display()
            )),
            "{}: {stderr}",
            path.display()
        );
        assert!(
            std::fs::read(&path).unwrap() == before,
            "{} kept as it was",
            path.display()
        );
        std::os::unix::fs::chown(&path, Some(0), Some(0)).unwrap();
    }
    // A data directory of another user is refused too, and left alone.
    std::os::unix::fs::chown(&data, Some(OTHER_UID), Some(OTHER_UID)).unwrap();
    let stderr = refused(&server);
    assert!(
        stderr.contains(&format!(
            "data directory {} is owned by uid {OTHER_UID}",
            data.display()
        )),
        "{stderr}"
    );
    std::os::unix::fs::chown(&data, Some(0), Some(0)).unwrap();
    // One readable by others is tightened, with a warning.
    chmod(&data, 0o755);
    server.restart();
    assert_eq!(mode_of(&data), 0o700);
    assert!(
        server.log().contains("tightened to 0700"),
        "{}",
        server.log()
    );
}

/// What a client running as `uid` reads after sending `request` to the
/// admin socket at `path`, or the errno its connect failed with.
///
/// The client is the child of a spawn: after the spawn drops to `uid`, a
/// `pre_exec` hook speaks to the socket with raw system calls (all
/// async-signal-safe, no allocation), copies the answer to its stdout and
/// exits before exec. (The test's binaries live under /root, which `nobody`
/// cannot execute.)
fn admin_as(uid: u32, path: &Path, request: &str) -> Result<String, i32> {
    // SAFETY: an all-zero sockaddr_un is a valid (empty) address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    assert!(bytes.len() < addr.sun_path.len());
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let request = format!("{request}\n").into_bytes();
    let mut cmd = Command::new("/bin/true");
    cmd.uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: the hook runs in the forked child and makes only
    // async-signal-safe calls (socket, connect, write, read, _exit) on
    // memory captured before the fork; it never returns.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            if fd < 0 || libc::connect(fd, (&raw const addr).cast(), len) != 0 {
                libc::_exit(100 + *libc::__errno_location());
            }
            libc::write(fd, request.as_ptr().cast(), request.len());
            let mut buf = [0u8; 512];
            loop {
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                if n <= 0 {
                    break;
                }
                libc::write(1, buf.as_ptr().cast(), n as usize);
            }
            libc::_exit(0);
        });
    }
    let out = cmd.output().expect("spawning the other user's client");
    match out.status.code() {
        Some(0) => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        Some(c) if c >= 100 => Err(c - 100),
        other => panic!("the client ended with {other:?}"),
    }
}

#[test]
fn the_admin_socket_is_0600_and_answers_only_its_own_uid_or_root() {
    let mut server = Server::start("16M", &[]);
    let admin = server.admin_path();
    assert_eq!(mode_of(&admin), 0o600);
    // Let the other user walk to the socket: the mode alone refuses it.
    chmod(server.dir.path(), 0o755);
    chmod(&data_dir(&server), 0o755);
    assert_eq!(
        admin_as(OTHER_UID, &admin, "status"),
        Err(libc::EACCES),
        "a 0600 socket cannot be connected to by another user"
    );
    // Widen the mode by hand: the peer check (SO_PEERCRED) still refuses,
    // and a refused `inject crash` crashes nothing.
    chmod(&admin, 0o666);
    let answer = admin_as(OTHER_UID, &admin, "inject crash").expect("connects now");
    assert!(
        answer.starts_with(&format!(
            "error: permission denied: uid {OTHER_UID} may not use this admin socket"
        )),
        "{answer}"
    );
    assert!(server.alive(), "the refused crash did not run");
    // The answer may reach us before the warning reaches the log file
    // (through the harness's reader thread).
    assert!(
        server.logs_within("admin request refused", std::time::Duration::from_secs(10)),
        "a warning is logged: {}",
        server.log()
    );
    // Root (our own uid here) is answered, through the same socket.
    let status = admin_as(0, &admin, "health").expect("root connects");
    assert!(status.starts_with("ok\n"), "{status}");
    server
        .admin("status")
        .expect("the server's own uid is answered");
}

#[test]
fn a_regular_file_at_the_admin_path_is_kept_and_the_start_fails_naming_it() {
    let mut server = Server::start("16M", &[]);
    server.stop();
    let admin = server.admin_path();
    assert!(!admin.exists(), "a clean stop removes its own socket");
    std::fs::write(&admin, b"not a socket").unwrap();
    let stderr = refused(&server);
    assert!(
        stderr.contains(&format!("{} exists and is a regular file", admin.display())),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&admin).unwrap(), b"not a socket");
}

#[test]
fn a_stale_admin_socket_is_replaced_and_a_live_one_is_another_servers() {
    let mut server = Server::start("16M", &[]);
    let admin = server.admin_path();
    server.kill9();
    assert!(
        std::fs::symlink_metadata(&admin)
            .unwrap()
            .file_type()
            .is_socket(),
        "a killed server leaves its socket behind"
    );
    server.restart();
    server
        .admin("status")
        .expect("the stale socket was replaced");
    assert_eq!(mode_of(&admin), 0o600);

    // A second server pointed at the live socket is refused, and the
    // first one keeps its socket.
    let mut other = Server::start("16M", &[]);
    other.stop();
    other.set_flag("--admin", admin.to_str().unwrap());
    let stderr = refused(&other);
    assert!(
        stderr.contains(&format!("another server is using {}", admin.display())),
        "{stderr}"
    );
    server
        .admin("status")
        .expect("the first server's socket is intact");
    server.stop();
    assert!(!admin.exists(), "removed on a clean stop");
}
