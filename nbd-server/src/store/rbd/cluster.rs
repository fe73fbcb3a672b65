//! What an `rbd:` export names, and a connected cluster handle (`rados_t`) shared by every
//! image of a server.

use super::*;

/// What an `rbd:` export names: `pool/image` or `pool/image@snapshot` (qemu's spelling,
/// without its `:key=value` options, which are our --ceph-* flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdSpec {
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// The snapshot, if one is served.
    pub snapshot: Option<String>,
}

impl RbdSpec {
    /// Parses what follows `rbd:`.
    pub fn parse(s: &str) -> Result<RbdSpec, String> {
        let usage = "rbd:POOL/IMAGE or rbd:POOL/IMAGE@SNAPSHOT";
        let (pool, rest) = s
            .split_once('/')
            .ok_or_else(|| format!("rbd:{s}: no pool ({usage})"))?;
        let (image, snapshot) = match rest.split_once('@') {
            Some((i, snap)) => (i, Some(snap.to_owned())),
            None => (rest, None),
        };
        if pool.is_empty() || image.is_empty() || snapshot.as_deref() == Some("") {
            return Err(format!("rbd:{s}: an empty name ({usage})"));
        }
        if image.contains('/') || image.contains(':') || pool.contains(':') {
            return Err(format!(
                "rbd:{s}: namespaces and :key=value options are not supported ({usage}; the cluster options are --ceph-conf, --ceph-id and --ceph-keyring)"
            ));
        }
        Ok(RbdSpec {
            pool: pool.to_owned(),
            image: image.to_owned(),
            snapshot,
        })
    }
}

impl std::fmt::Display for RbdSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rbd:{}/{}", self.pool, self.image)?;
        if let Some(s) = &self.snapshot {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

/// A connected cluster handle (`rados_t`), shared by the exports that use it.
pub struct Cluster {
    pub(super) handle: ffi::rados_t,
    pub(super) id: String,
    pub(super) conf: String,
}

// SAFETY: librados' cluster handle is thread-safe (its calls take their own locks); we only
// shut it down in Drop, when no image or I/O context made from it is left (they hold an Arc).
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("id", &self.id)
            .field("conf", &self.conf)
            .finish()
    }
}

impl Cluster {
    /// Connects, or says in one line why it cannot.
    pub fn connect(opts: &CephOptions) -> Result<Arc<Cluster>, String> {
        let id = opts.id.clone().unwrap_or_else(|| "admin".to_owned());
        let conf = opts.conf.as_deref().map_or_else(
            || "the default ceph.conf".to_owned(),
            |p| p.display().to_string(),
        );
        if let Some(p) = &opts.conf
            && !p.exists()
        {
            return Err(format!("Ceph configuration {} does not exist", p.display()));
        }
        if let Some(p) = &opts.keyring
            && !p.exists()
        {
            return Err(format!("Ceph keyring {} does not exist", p.display()));
        }
        let e = |what: &str, err: io::Error| format!("{what}: {err}");
        let name = cstring("client id", &format!("client.{id}")).map_err(|x| e("ceph id", x))?;
        let cluster_name = c"ceph";
        let mut handle: ffi::rados_t = std::ptr::null_mut();
        // SAFETY: handle is a valid out-pointer; the strings are NUL-terminated and outlive
        // the call (librados copies them).
        check(unsafe { ffi::rados_create2(&mut handle, cluster_name.as_ptr(), name.as_ptr(), 0) })
            .map_err(|x| e("creating the Ceph client", x))?;
        // From here on, Drop shuts the handle down on every early return.
        let cluster = Cluster {
            handle,
            id: id.clone(),
            conf: conf.clone(),
        };
        let path = match &opts.conf {
            Some(p) => Some(cstring("path", &p.display().to_string()).map_err(|x| e("conf", x))?),
            None => None,
        };
        // SAFETY: the handle is created and not connected; path is NULL (search) or a C
        // string that outlives the call.
        let r = unsafe {
            ffi::rados_conf_read_file(
                cluster.handle,
                path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
            )
        };
        if r < 0 {
            return Err(match opts.conf {
                Some(_) => format!("reading Ceph configuration {conf}: {}", errno(r)),
                None => "no Ceph configuration found (give --ceph-conf, or set CEPH_CONF, or create /etc/ceph/ceph.conf)".to_owned(),
            });
        }
        let secs = opts.timeout.as_secs().max(1).to_string();
        let mut settings = vec![
            // librados' own messages would go to our stderr; our errors say what failed.
            ("log_to_stderr", "false".to_owned()),
            ("err_to_stderr", "false".to_owned()),
            ("client_mount_timeout", secs.clone()),
            ("rados_mon_op_timeout", secs.clone()),
            ("rados_osd_op_timeout", secs),
        ];
        if let Some(k) = &opts.keyring {
            settings.push(("keyring", k.display().to_string()));
        }
        for (k, v) in settings {
            let (ck, cv) = (cstring("option", k), cstring("value", &v));
            let (ck, cv) = (ck.map_err(|x| e(k, x))?, cv.map_err(|x| e(k, x))?);
            // SAFETY: the handle is valid; both strings outlive the call (librados copies).
            check(unsafe { ffi::rados_conf_set(cluster.handle, ck.as_ptr(), cv.as_ptr()) })
                .map_err(|x| format!("setting Ceph option {k}={v}: {x}"))?;
        }
        // SAFETY: the handle is configured and not yet connected.
        let r = unsafe { ffi::rados_connect(cluster.handle) };
        if r < 0 {
            let err = errno(r);
            let secs = opts.timeout.as_secs();
            return Err(match -r {
                libc::ETIMEDOUT => format!(
                    "cannot reach the Ceph cluster of {conf}: no monitor answered in {secs} s (is it running? see mon_host there)"
                ),
                libc::ENOENT => format!(
                    "connecting to the Ceph cluster as client.{id}: no keyring with its key (give --ceph-keyring, or keyring in {conf})"
                ),
                libc::EACCES | libc::EPERM => format!(
                    "the Ceph cluster refused client.{id}: {err} (a wrong key in the keyring?)"
                ),
                _ => format!("connecting to the Ceph cluster of {conf} as client.{id}: {err}"),
            });
        }
        Ok(Arc::new(cluster))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: created by rados_create2 and used by nothing else any more (every I/O
        // context holds an Arc<Cluster>, so they are all gone).
        unsafe { ffi::rados_shutdown(self.handle) }
    }
}
