//! The tier's directory: checking it exists (or creating it), the exclusive lock that keeps a
//! second process out, and the probe that decides O_DIRECT.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::StoreError;
use crate::aligned_buf::{AlignedBuf, IO_ALIGN};

use super::DirectIo;

const LOCK_FILE: &str = "LOCK";

pub(super) fn prepare_dir(dir: &Path, create: bool) -> Result<(), StoreError> {
    let err = |reason: String| StoreError::DiskDir {
        path: dir.to_owned(),
        reason,
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(err("not a directory".into())),
        Err(e) if e.kind() == io::ErrorKind::NotFound && create => {
            std::fs::create_dir_all(dir).map_err(|e| err(format!("cannot create it: {e}")))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(err("does not exist (create it, or set create_dir)".into()))
        }
        Err(e) => Err(err(e.to_string())),
    }
}

/// Takes an exclusive `flock` on `dir/LOCK` (released when the process exits, even by SIGKILL)
/// and writes our pid into it.
pub(super) fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("cannot open {}: {e}", path.display()),
        })?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = std::fs::read_to_string(&path)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .map_or_else(|| "unknown pid".into(), |pid| format!("pid {pid}"));
        return Err(StoreError::DirLocked {
            path: dir.to_owned(),
            holder,
        });
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|()| file.write_all_at(pid.as_bytes(), 0))
        .map_err(|e| StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("cannot write {}: {e}", path.display()),
        })?;
    let _ = file.flush();
    Ok(file)
}

/// Decides O_DIRECT: tries an aligned write to a probe file opened with it.
pub(super) fn probe_direct_io(dir: &Path, mode: DirectIo) -> Result<bool, StoreError> {
    if mode == DirectIo::Off {
        return Ok(false);
    }
    let probe = dir.join(".direct-io-probe");
    let result = (|| -> io::Result<()> {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&probe)?;
        f.write_all_at(&AlignedBuf::new(IO_ALIGN), 0)
    })();
    let _ = std::fs::remove_file(&probe);
    match (result, mode) {
        (Ok(()), _) => Ok(true),
        (Err(e), DirectIo::On) => Err(StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("O_DIRECT requested but refused by the file system: {e}"),
        }),
        (Err(e), _) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(dir = %dir.display(), "O_DIRECT not supported here; using buffered I/O");
            Ok(false)
        }
        (Err(e), _) => Err(StoreError::DiskDir {
            path: dir.to_owned(),
            reason: format!("cannot write in it: {e}"),
        }),
    }
}
