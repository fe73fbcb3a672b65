//! The hand-written declarations of the librados and librbd functions we call (see
//! rados/librados.h and rbd/librbd.h).

use std::ffi::{c_char, c_int, c_void};

pub(super) type rados_t = *mut c_void;
pub(super) type rados_ioctx_t = *mut c_void;
pub(super) type rbd_image_t = *mut c_void;
pub(super) type rbd_completion_t = *mut c_void;
pub(super) type rbd_callback_t = Option<unsafe extern "C" fn(rbd_completion_t, *mut c_void)>;
pub(super) type diff_cb = unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;
pub(super) type rbd_update_callback_t = unsafe extern "C" fn(*mut c_void);

/// rbd_encryption_luks1_format_options_t and rbd_encryption_luks2_format_options_t (the
/// same layout); `alg` is not used by rbd_encryption_load.
#[repr(C)]
pub(super) struct rbd_encryption_luks_format_options_t {
    pub alg: c_int,
    pub passphrase: *const c_char,
    pub passphrase_size: usize,
}
pub(super) const RBD_ENCRYPTION_FORMAT_LUKS1: c_int = 0;
pub(super) const RBD_ENCRYPTION_FORMAT_LUKS2: c_int = 1;

/// rbd_image_watcher_t.
#[repr(C)]
pub(super) struct rbd_image_watcher_t {
    pub addr: *mut c_char,
    pub id: i64,
    pub cookie: u64,
}

/// rbd_image_info_t.
#[repr(C)]
pub(super) struct rbd_image_info_t {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; 24],
    pub parent_pool: i64,
    pub parent_name: [c_char; 96],
}

/// RBD_LOCK_MODE_EXCLUSIVE of rbd_lock_mode_t.
pub(super) const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;
/// RBD_FEATURE_EXCLUSIVE_LOCK.
pub(super) const RBD_FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

#[link(name = "rados")]
unsafe extern "C" {
    pub(super) fn rados_create2(
        cluster: *mut rados_t,
        clustername: *const c_char,
        name: *const c_char,
        flags: u64,
    ) -> c_int;
    pub(super) fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    pub(super) fn rados_conf_set(
        cluster: rados_t,
        option: *const c_char,
        value: *const c_char,
    ) -> c_int;
    pub(super) fn rados_connect(cluster: rados_t) -> c_int;
    pub(super) fn rados_shutdown(cluster: rados_t);
    pub(super) fn rados_ioctx_create(
        cluster: rados_t,
        pool: *const c_char,
        ioctx: *mut rados_ioctx_t,
    ) -> c_int;
    pub(super) fn rados_ioctx_destroy(ioctx: rados_ioctx_t);
}

#[link(name = "rbd")]
unsafe extern "C" {
    pub(super) fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub(super) fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub(super) fn rbd_close(image: rbd_image_t) -> c_int;
    pub(super) fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    pub(super) fn rbd_resize(image: rbd_image_t, size: u64) -> c_int;
    pub(super) fn rbd_encryption_load(
        image: rbd_image_t,
        format: c_int,
        opts: *mut c_void,
        opts_size: usize,
    ) -> c_int;
    pub(super) fn rbd_update_watch(
        image: rbd_image_t,
        handle: *mut u64,
        watch_cb: rbd_update_callback_t,
        arg: *mut c_void,
    ) -> c_int;
    pub(super) fn rbd_update_unwatch(image: rbd_image_t, handle: u64) -> c_int;
    pub(super) fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    pub(super) fn rbd_lock_acquire(image: rbd_image_t, lock_mode: c_int) -> c_int;
    pub(super) fn rbd_lock_get_owners(
        image: rbd_image_t,
        lock_mode: *mut c_int,
        lock_owners: *mut *mut c_char,
        max_lock_owners: *mut usize,
    ) -> c_int;
    pub(super) fn rbd_lock_get_owners_cleanup(lock_owners: *mut *mut c_char, count: usize);
    pub(super) fn rbd_watchers_list(
        image: rbd_image_t,
        watchers: *mut rbd_image_watcher_t,
        max_watchers: *mut usize,
    ) -> c_int;
    pub(super) fn rbd_watchers_list_cleanup(watchers: *mut rbd_image_watcher_t, count: usize);
    pub(super) fn rbd_stat(
        image: rbd_image_t,
        info: *mut rbd_image_info_t,
        infosize: usize,
    ) -> c_int;
    pub(super) fn rbd_diff_iterate2(
        image: rbd_image_t,
        fromsnapname: *const c_char,
        ofs: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        cb: diff_cb,
        arg: *mut c_void,
    ) -> c_int;

    pub(super) fn rbd_aio_create_completion(
        cb_arg: *mut c_void,
        complete_cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    pub(super) fn rbd_aio_wait_for_complete(c: rbd_completion_t) -> c_int;
    pub(super) fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    pub(super) fn rbd_aio_release(c: rbd_completion_t);

    pub(super) fn rbd_aio_read(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *mut c_char,
        c: rbd_completion_t,
    ) -> c_int;
    pub(super) fn rbd_aio_write(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *const c_char,
        c: rbd_completion_t,
    ) -> c_int;
    pub(super) fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    pub(super) fn rbd_aio_discard(
        image: rbd_image_t,
        off: u64,
        len: u64,
        c: rbd_completion_t,
    ) -> c_int;
    pub(super) fn rbd_aio_write_zeroes(
        image: rbd_image_t,
        off: u64,
        len: usize,
        c: rbd_completion_t,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
}
