//! The exports: each one's store opened through the library's `store::open`, the demo
//! image made, and the exports in a format the server does not serve left out.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nbd_server::export::{Export, MetaContext};
use nbd_server::store::open::{self, Location, OpenOptions, Opener};
use nbd_server::store::overlay::Overlay;
use nbd_server::store::view::{self, Cache, DetectZeroes, Discard, ViewOptions};
use nbd_server::store::{CephOptions, Encryption, Store};
use qpip_core::Nic;

use crate::args::{CacheArg, Cli, DetectZeroesArg, DiscardArg};
use crate::config::{ExportConfig, parse_size};
use crate::settings::Settings;

const DEMO_SIZE: u64 = 64 << 20;

/// Opens every export's store and registers it with the NIC. An export whose file is in a
/// format the server does not serve is left out with an error line, unless none is left.
pub(crate) fn open_all(nic: &Nic, cli: &Cli, settings: &Settings) -> Result<Vec<Arc<Export>>> {
    let mut opener = Opener::new(CephOptions {
        conf: cli.ceph_conf.clone(),
        id: cli.ceph_id.clone(),
        keyring: cli.ceph_keyring.clone(),
        timeout: Duration::from_secs(cli.ceph_timeout),
    });
    let view = view_options(cli)?;
    let mut exports: Vec<Arc<Export>> = Vec::new();
    // Exports whose file is in a format the server does not serve, with why.
    let mut left_out = Vec::new();
    for e in &settings.cfg.exports {
        if exports.iter().any(|x| x.name == e.name) {
            bail!("export {:?} is given twice", e.name);
        }
        let store = if settings.demo {
            demo_store()?
        } else {
            match open_one(&mut opener, cli, e)? {
                Ok(store) => store,
                Err(err) => {
                    left_out.push(err);
                    continue;
                }
            }
        };
        let store = snapshot(cli, e, store)?;
        let store = view::apply(store, view).with_context(|| format!("export {}", e.name))?;
        tracing::info!(export = %e.name, "{} ({}, {} bytes{})", store.location(), store.kind(), store.size(), if store.read_only() { ", read-only" } else { "" });
        let contexts = contexts(cli, e, store.as_ref())?;
        exports.push(Export::new(
            nic,
            e.name.clone(),
            e.description.clone(),
            store,
            contexts,
        ));
    }
    // With no export left the server fails with the last one's error, as with one export.
    if exports.is_empty()
        && let Some(err) = left_out.pop()
    {
        for e in &left_out {
            tracing::error!("{e:#}");
        }
        return Err(err);
    }
    for e in &left_out {
        tracing::error!("{e:#}; serving the other exports without it");
    }
    Ok(exports)
}

/// The contexts an export offers besides base:allocation, in qemu-nbd's order:
/// allocation depth, then the bitmaps, the last given first. A bitmap the image cannot serve
/// (missing, inconsistent; a raw image) stops the server, as it stops qemu-nbd.
fn contexts(cli: &Cli, e: &ExportConfig, store: &dyn Store) -> Result<Vec<MetaContext>> {
    let mut contexts = Vec::new();
    if cli.allocation_depth || e.allocation_depth {
        contexts.push(MetaContext::AllocationDepth);
    }
    let mut names: Vec<&String> = Vec::new();
    for name in cli.bitmap.iter().chain(&e.bitmap) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    for name in names.into_iter().rev() {
        store.has_bitmap(name).context(store.location())?;
        contexts.push(MetaContext::DirtyBitmap(name.clone()));
    }
    Ok(contexts)
}

/// --offset, --discard, --detect-zeroes and --cache, checked before any image is opened.
pub(crate) fn view_options(cli: &Cli) -> Result<ViewOptions> {
    let opts = ViewOptions {
        offset: match cli.offset.as_deref() {
            Some(o) => parse_size(o).context("--offset")?,
            None => 0,
        },
        discard: match cli.discard {
            Some(DiscardArg::Ignore) => Discard::Ignore,
            Some(DiscardArg::Unmap) | None => Discard::Unmap,
        },
        detect_zeroes: match cli.detect_zeroes {
            Some(DetectZeroesArg::On) => DetectZeroes::On,
            Some(DetectZeroesArg::Unmap) => DetectZeroes::Unmap,
            Some(DetectZeroesArg::Off) | None => DetectZeroes::Off,
        },
        cache: match cli.cache.or(cli.nocache.then_some(CacheArg::None)) {
            Some(CacheArg::Writeback | CacheArg::None) | None => Cache::Writeback,
            Some(CacheArg::Writethrough | CacheArg::Directsync) => Cache::Writethrough,
            Some(CacheArg::Unsafe) => Cache::Unsafe,
        },
    };
    if opts.detect_zeroes == DetectZeroes::Unmap && opts.discard == Discard::Ignore {
        bail!("--detect-zeroes unmap needs --discard unmap (the default), as in qemu-nbd");
    }
    Ok(opts)
}

/// Opens one export's store: Ok(Err) for a file in a format the server does not serve,
/// which takes down its own export only (a guest must not be able to stop the server).
fn open_one(
    opener: &mut Opener,
    cli: &Cli,
    e: &ExportConfig,
) -> Result<Result<Box<dyn Store>, anyhow::Error>> {
    let create = match cli.create.as_deref().or(e.create_size.as_deref()) {
        Some(size) => Some(parse_size(size)?),
        None => None,
    };
    let backing_dirs: Vec<_> = cli
        .allow_backing_dir
        .iter()
        .chain(&e.allow_backing_dir)
        .cloned()
        .collect();
    if let Some(d) = backing_dirs.iter().find(|d| !d.is_dir()) {
        bail!(
            "export {}: --allow-backing-dir {}: not a directory",
            e.name,
            d.display()
        );
    }
    let opts = OpenOptions {
        // Snapshot mode never writes the image: its locks are shared read locks.
        read_only: cli.read_only || e.read_only || cli.snapshot || e.snapshot,
        format: cli.format.or(e.format).map(Into::into),
        create,
        lock: !cli.force_share,
        exclusive: cli.exclusive,
        encryption: match (e.encryption_format, &e.encryption_passphrase_file) {
            (Some(format), Some(file)) => Some(Encryption {
                format: format.into(),
                passphrase_file: file.clone(),
            }),
            (None, _) => None,
            (Some(_), None) => bail!(
                "export {}: --encryption-format needs --encryption-passphrase-file",
                e.name
            ),
        },
        // An encrypted qcow2 image names its own format: the passphrase is all it needs.
        passphrase_file: match Location::parse(&e.path) {
            Location::File(_) => e.encryption_passphrase_file.clone(),
            Location::Rbd(_)
                if e.encryption_passphrase_file.is_some() && e.encryption_format.is_none() =>
            {
                bail!(
                    "export {}: --encryption-passphrase-file needs --encryption-format (luks1 or luks2) for an rbd: image",
                    e.name
                )
            }
            Location::Rbd(_) => None,
        },
        backing_dirs,
        deadline: (cli.open_timeout > 0).then(|| Duration::from_secs(cli.open_timeout)),
        snapshot: cli
            .load_snapshot
            .clone()
            .or_else(|| e.load_snapshot.clone()),
    };
    match opener.open(&e.path, &opts) {
        Ok(store) => Ok(Ok(store)),
        Err(err) if err.unserved() => Ok(Err(
            anyhow::Error::new(err).context(format!("export {}", e.name))
        )),
        Err(err) => Err(anyhow::Error::new(err).context(format!("export {}", e.name))),
    }
}

/// Snapshot mode (--snapshot): the store, opened read-only, with its writes sent to an
/// overlay in $TMPDIR; read-only too with --read-only, as qemu-nbd's read-only snapshot.
fn snapshot(cli: &Cli, e: &ExportConfig, store: Box<dyn Store>) -> Result<Box<dyn Store>> {
    if !(cli.snapshot || e.snapshot) {
        return Ok(store);
    }
    if cli.read_only || e.read_only {
        tracing::info!(export = %e.name, "snapshot mode, read-only: no overlay is needed");
        return Ok(store);
    }
    let overlay =
        Overlay::new(store, &std::env::temp_dir()).with_context(|| format!("export {}", e.name))?;
    tracing::info!(
        export = %e.name,
        "snapshot mode: writes go to a temporary overlay in {}, thrown away at exit (cluster map: {} KiB)",
        overlay.dir().display(),
        overlay.map_bytes().div_ceil(1024)
    );
    Ok(Box::new(overlay))
}

/// The demo export: a generated image in anonymous memory (a memfd). Not a file under
/// $TMPDIR: a predictable path there lets any local user plant a symlink to a file of
/// root's, which the server would then export read-write.
fn demo_store() -> Result<Box<dyn Store>> {
    let store = open::anonymous("qpip-demo.img", DEMO_SIZE).context("creating the demo image")?;
    let banner = b"qpip demo image: served by qpip-nbd-server over Queue Pair IP\n";
    store
        .write_at(banner, 0, false)
        .context("writing the demo image")?;
    Ok(store)
}
