//! qpip-bench: measures the QPIP stack against kernel sockets and socket NBD stacks, side by
//! side in one run.

mod cpu;
mod ext2;
mod lanai;
mod micro;
mod nbd;
mod pattern;
mod plot;
mod progress;
mod qd1;
mod report;
mod rig;
mod stats;
mod sweep;
mod units;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use qpip_cli::{out, outln};

use rig::netns::NetnsArgs;
use rig::peers;

#[derive(Parser)]
#[command(
    name = "qpip-bench",
    version,
    about = "Benchmarks of the QPIP stack, each side by side with its peer in one run"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    // Logging: -v/-q from the default, warn.
    #[command(flatten)]
    log: qpip_cli::logging::LogArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// QP verbs against kernel sockets: host overhead per 1-byte message; round-trip time over
    /// TCP and UDP with every thread's CPU per round trip, a QP whose completion waits spin
    /// (200 µs) against sockets that busy-poll (non-blocking recv in a loop) and a QP whose
    /// waits sleep at once (set_spin(0)) against blocking sockets; ttcp throughput (10 MB in
    /// 16 KiB messages; 1 GiB in 128 KiB messages) with application and NIC-engine CPU per GB.
    Micro {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Runs per measure; medians are reported.
        #[arg(long, default_value_t = 5)]
        repeat: usize,
        /// Smaller counts (seconds instead of minutes), for smoke tests.
        #[arg(long)]
        quick: bool,
        /// Fail if the process holds more descriptors or threads after the run than before
        /// it: every NIC the benchmarks opened must have given back what it took (tests).
        #[arg(long, hide = true)]
        check_leaks: bool,
        /// Run only this row, `--repeat` times, and print each run's figures (to profile
        /// one row, e.g. under `perf stat`): round trips spin (QP) or busy-poll (sockets);
        /// ttcp rows stream `--count` MB.
        #[arg(long, value_enum, conflicts_with = "json")]
        only: Option<micro::Row>,
        /// With `--only`: round trips per run (110 % of it: the first tenth warms up; default
        /// 100 000), or MB per ttcp run (default 1 000).
        #[arg(long, requires = "only")]
        count: Option<u64>,
        #[command(flatten)]
        net: NetnsArgs,
    },
    /// The far side of one `micro` measure, as a process of its own (run by `micro --netns`
    /// inside the namespace).
    #[command(hide = true)]
    MicroEcho {
        job: String,
        #[arg(long)]
        listen: std::net::IpAddr,
    },
    /// The paper's experiments on the emulated LANai 9 and Myrinet, predicted in virtual
    /// time from the model's inputs: 1-byte RTT over UDP and TCP (hardware and firmware
    /// receive checksum), ttcp at MTU 16384/9000/1500, NIC occupancy per stage, host CPU, and
    /// the what-if table of hardware support.
    Lanai {
        /// Print one JSON object instead of tables.
        #[arg(long)]
        json: bool,
        /// NIC, cost and host parameters (default: the embedded configs/lanai.toml).
        #[arg(long, value_name = "FILE")]
        params: Option<PathBuf>,
        /// Fabric parameters (default: the embedded configs/fabric.toml).
        #[arg(long, value_name = "FILE")]
        fabric: Option<PathBuf>,
        /// Fewer round trips and a 512 KiB ttcp (smoke tests).
        #[arg(long)]
        quick: bool,
    },
    /// NBD servers side by side: qpip-nbd-server, nbdkit and qemu-nbd, with fio's nbd engine
    /// as the client of all three.
    Nbd {
        #[command(subcommand)]
        cmd: NbdCmd,
    },
}

#[derive(Subcommand)]
enum NbdCmd {
    /// Sequential write then read of a sparse raw image (default 1 GiB in 256 KiB requests,
    /// 16 in flight): MB/s, server CPU per GB and fio CPU per GB for each server.
    Raw(RawArgs),
    /// (root) The paper's network storage benchmark: ext2 on a loop device on a FUSE file
    /// backed by an NBD export. Writes a file sequentially + sync, unmounts, drops caches,
    /// remounts, reads it back and verifies it. qpip (qpip-nbd-server + qpip-nbd-mount)
    /// against nbd-server, nbdkit and qemu-nbd behind qemu-storage-daemon's FUSE export: MB/s
    /// and MB per CPU-second, CPU split into server, NIC engine, client/FUSE and kernel.
    Ext2(Ext2Args),
    /// (root) Latency at queue depth 1 through a FUSE mount: 4 KiB O_DIRECT random reads, then
    /// writes (fio psync, iodepth 1), on qpip-nbd-mount --cache none over qpip-nbd-server
    /// against qemu-storage-daemon's FUSE export over nbdkit: IOPS, p50 and p99 latency, CPU
    /// per 10 000 operations, and the verdict against issue 29's goals.
    Qd1(Qd1Args),
    /// Raw sequential NBD I/O over request sizes and queue depths: our client (nbd_client's
    /// pipelined API) against qpip-nbd-server, fio's nbd engine against nbdkit and qemu-nbd.
    Sweep(SweepArgs),
}

/// The qpip programs a mount experiment runs.
#[derive(clap::Args)]
struct Bins {
    /// The qpip-nbd-server to measure. Default: the one next to this executable.
    #[arg(long, value_name = "PATH")]
    server_bin: Option<PathBuf>,
    /// The qpip-nbd-mount to measure. Default: the one next to this executable.
    #[arg(long, value_name = "PATH")]
    mount_bin: Option<PathBuf>,
}

impl Bins {
    /// (server, mount), the defaults filled in.
    fn resolve(self) -> Result<(PathBuf, PathBuf)> {
        let server = self.server_bin.map_or_else(peers::default_server_bin, Ok)?;
        let mount = self.mount_bin.map_or_else(ext2::default_mount_bin, Ok)?;
        Ok((server, mount))
    }
}

/// The options of `qpip-bench nbd raw`.
#[derive(clap::Args)]
struct RawArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Rounds; every round runs all servers (interleaved); medians and min/max are reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Image size and bytes moved per pass (k, M, G, T: binary units).
    #[arg(long, default_value = "1G", value_parser = units::parse_size)]
    size: u64,
    /// Request size.
    #[arg(long, default_value = "256k", value_parser = units::parse_size)]
    bs: u64,
    /// Requests in flight (per connection).
    #[arg(long, default_value_t = 16)]
    iodepth: u32,
    /// Connections, as fio's --numjobs: each moves its own slice of --size with --iodepth
    /// requests in flight; figures are their sum.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    jobs: u32,
    /// The qpip-nbd-server to measure. Default: the one next to this executable.
    #[arg(long, value_name = "PATH")]
    server_bin: Option<PathBuf>,
    /// Directory for the image files. Default: a fresh temporary directory. The images
    /// are deleted afterwards either way.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Time the first write of fresh sparse images. By default each image is written
    /// once, untimed, before the timed write pass, which then overwrites cached blocks:
    /// that keeps the cost of allocating fresh page-cache pages (large and erratic in VMs
    /// whose memory the host backs lazily) out of the comparison.
    #[arg(long)]
    fresh: bool,
    /// The default (prewritten images); kept so that older commands still run.
    #[arg(long, hide = true, conflicts_with = "fresh")]
    prewrite: bool,
    /// Every server requires TLS (x509; credentials made for the run with
    /// scripts/tls-test-certs), fio connecting with nbds://.
    #[arg(long)]
    tls: bool,
    /// Two more rows: qpip-nbd-server's rbd: export and qemu-nbd's own rbd: driver,
    /// each on a fresh image of the Ceph cluster that this ceph.conf names (e.g.
    /// /tmp/qpip-ceph/ceph.conf of scripts/ceph-dev; the server needs the rbd feature).
    #[arg(long, value_name = "FILE")]
    rbd_conf: Option<PathBuf>,
    /// The pool for those images.
    #[arg(long, value_name = "POOL", default_value = "rbd")]
    rbd_pool: String,
    #[command(flatten)]
    net: NetnsArgs,
}

/// The options of `qpip-bench nbd ext2`.
#[derive(clap::Args)]
struct Ext2Args {
    /// Print one JSON object (every figure) instead of a table.
    #[arg(long)]
    json: bool,
    /// Rounds; every round runs all stacks (interleaved); medians and min/max are reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Size of the file written and read back (binary units: 409M = 409 MiB).
    #[arg(long, default_value = "409M", value_parser = units::parse_size)]
    file_size: u64,
    /// Stacks to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "qpip,qpip-direct,nbd-server,nbdkit,qemu-nbd",
          value_parser = ext2::Stack::parse)]
    stacks: Vec<ext2::Stack>,
    #[command(flatten)]
    bins: Bins,
    /// An extra argument for qpip-nbd-mount (repeatable), e.g.
    /// `--mount-arg=--fuse-transport=dev` to measure the /dev/fuse transport.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    mount_arg: Vec<String>,
    /// Work directory for images and mount points (default: a fresh one on /dev/shm);
    /// removed afterwards.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// The loop device's direct I/O on the FUSE file (losetup --direct-io=on|off). `auto`
    /// (the default) gives each stack the setting its users should use: on for the qpip
    /// stacks (README's recipe: one page cache, not two), off for qemu-storage-daemon's FUSE
    /// export, which (QEMU 10.0) returns corrupt blocks to the read-back check with it on.
    #[arg(long, value_enum, default_value_t = ext2::LoopDirectIo::Auto)]
    loop_direct_io: ext2::LoopDirectIo,
    /// Directory for the plot (qpip-bench-ext2.svg).
    #[arg(long, value_name = "DIR", default_value = ".")]
    plot_dir: PathBuf,
    /// Write no plot.
    #[arg(long)]
    no_plot: bool,
    #[command(flatten)]
    net: NetnsArgs,
}

/// The options of `qpip-bench nbd qd1`.
#[derive(clap::Args)]
struct Qd1Args {
    /// Print one JSON object (every figure) instead of a table.
    #[arg(long)]
    json: bool,
    /// Rounds; every round runs both stacks (interleaved); medians and min/max are reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Image size (random data; fio's offsets range over all of it).
    #[arg(long, default_value = "1G", value_parser = units::parse_size)]
    size: u64,
    /// Seconds of each fio run (randread, randwrite).
    #[arg(long, default_value_t = 8.0)]
    runtime: f64,
    #[command(flatten)]
    bins: Bins,
    /// An extra argument for qpip-nbd-mount (repeatable), after `--cache none`.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    mount_arg: Vec<String>,
    /// Directory in which a fresh work directory (image, mount points, logs) is made and
    /// removed afterwards. Default: /dev/shm.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    #[command(flatten)]
    net: NetnsArgs,
}

/// The options of `qpip-bench nbd sweep`.
#[derive(clap::Args)]
struct SweepArgs {
    /// Print one JSON object (every figure) instead of a table.
    #[arg(long)]
    json: bool,
    /// Rounds; medians and min/max are reported.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Request sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4k,64k,256k,1m,4m",
          value_parser = units::parse_size)]
    sizes: Vec<u64>,
    /// Queue depths (requests in flight), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    depths: Vec<u32>,
    /// Bytes per point at most (and the image size).
    #[arg(long, default_value = "256M", value_parser = units::parse_size)]
    point_size: u64,
    /// Seconds per point at most.
    #[arg(long, default_value_t = 2.0)]
    point_time: f64,
    /// The qpip-nbd-server to measure. Default: the one next to this executable.
    #[arg(long, value_name = "PATH")]
    server_bin: Option<PathBuf>,
    /// Directory for the images (default: a fresh one on /dev/shm); removed afterwards.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Directory for the plots (qpip-bench-sweep-{write,read}.svg).
    #[arg(long, value_name = "DIR", default_value = ".")]
    plot_dir: PathBuf,
    /// Write no plots.
    #[arg(long)]
    no_plot: bool,
    #[command(flatten)]
    net: NetnsArgs,
}

fn main() {
    qpip_cli::man::generate_if_asked(<Cli as clap::CommandFactory>::command);
    let cli = Cli::parse();
    cli.log
        .init("qpip-bench", tracing_subscriber::filter::LevelFilter::WARN);
    // One line per error, never a backtrace.
    if let Err(e) = run(cli) {
        qpip_cli::stdout::exit_if_closed(&e);
        eprintln!("qpip-bench: {e:#}");
        std::process::exit(1);
    }
}

/// A plot directory is checked before a run of minutes, not after it.
fn check_plot_dir(dir: &std::path::Path, no_plot: bool) -> Result<()> {
    if no_plot {
        return Ok(());
    }
    let probe = dir.join(format!(".qpip-bench-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("--plot-dir {}: cannot write there", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Prints a report: its JSON (with `json`; the table then goes to stderr when
/// `table_with_json`, so the terminal still shows it) or its table.
fn emit(
    json: bool,
    report: &impl serde::Serialize,
    table: String,
    table_with_json: bool,
) -> Result<()> {
    if json {
        if table_with_json {
            eprint!("{table}");
        }
        outln!("{}", serde_json::to_string(report)?)?;
    } else {
        out!("{table}")?;
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Micro {
            json,
            repeat,
            quick,
            check_leaks,
            only,
            count,
            net,
        } => {
            let sizes = if quick {
                micro::MicroSizes::quick()
            } else {
                micro::MicroSizes::full()
            };
            let progress = |s: &str| eprintln!("qpip-bench micro: {s}");
            let link = net.create()?;
            if link.is_some() {
                rig::netns::clean_up_on_signals("qpip-bench micro: interrupted")?;
            }
            let side = link.as_ref().map(|l| &l.side);
            if let Some(row) = only {
                return micro::run_row(row, repeat, count, side, &mut |line| {
                    outln!("{line}")?;
                    Ok(())
                });
            }
            let run = || micro::run(repeat, sizes, side, &progress);
            let report = if check_leaks {
                micro::without_leaks(run)?
            } else {
                run()?
            };
            emit(json, &report, micro::table(&report), false)?;
        }
        Cmd::MicroEcho { job, listen } => micro::far::child_main(&job, listen)?,
        Cmd::Lanai {
            json,
            params,
            fabric,
            quick,
        } => {
            let (p, f) = lanai::load(params.as_deref(), fabric.as_deref())?;
            let sizes = if quick {
                lanai::Sizes::quick()
            } else {
                lanai::Sizes::full()
            };
            let progress = progress::Progress::new("qpip-bench lanai");
            let report = lanai::run(&p, &f, sizes, &progress)?;
            emit(json, &report, lanai::table(&report), false)?;
        }
        Cmd::Nbd { cmd } => match cmd {
            NbdCmd::Raw(a) => nbd_raw(a)?,
            NbdCmd::Ext2(a) => nbd_ext2(a)?,
            NbdCmd::Qd1(a) => nbd_qd1(a)?,
            NbdCmd::Sweep(a) => nbd_sweep(a)?,
        },
    }
    Ok(())
}

/// `qpip-bench nbd raw`.
fn nbd_raw(args: RawArgs) -> Result<()> {
    let RawArgs {
        json,
        repeat,
        size,
        bs,
        iodepth,
        jobs,
        server_bin,
        dir,
        fresh,
        prewrite: _,
        tls,
        rbd_conf,
        rbd_pool,
        net,
    } = args;
    let server_bin = match server_bin {
        Some(p) => p,
        None => peers::default_server_bin()?,
    };
    let progress = |s: &str| eprintln!("qpip-bench nbd raw: {s}");
    let report = nbd::run(
        size,
        bs,
        iodepth,
        jobs,
        repeat,
        server_bin,
        dir.as_deref(),
        !fresh,
        tls,
        rbd_conf.map(|conf| {
            let qemu = peers::qemu_has_rbd(&conf);
            if !qemu {
                progress(
                    "qemu-nbd has no rbd driver here (qemu-block-extra of this qemu): the qemu-nbd-rbd row is left out",
                );
            }
            peers::RbdBench {
                conf,
                pool: rbd_pool,
                qemu,
            }
        }),
        net,
        &progress,
    )?;
    emit(json, &report, nbd::table(&report), false)
}

/// `qpip-bench nbd ext2`.
fn nbd_ext2(args: Ext2Args) -> Result<()> {
    let Ext2Args {
        json,
        repeat,
        file_size,
        stacks,
        bins,
        mount_arg,
        dir,
        loop_direct_io,
        plot_dir,
        no_plot,
        net,
    } = args;
    check_plot_dir(&plot_dir, no_plot)?;
    let (server_bin, mount_bin) = bins.resolve()?;
    let progress = progress::Progress::new("qpip-bench nbd ext2");
    let opts = ext2::Options {
        file_size,
        repeat,
        stacks,
        server_bin,
        mount_bin,
        mount_args: mount_arg,
        dir,
        loop_direct_io,
        netns: net,
    };
    let report = ext2::run_all(opts, &progress)?;
    emit(json, &report, ext2::table(&report), true)?;
    if !no_plot {
        let path = plot_dir.join("qpip-bench-ext2.svg");
        plot::ext2(&report, &path)
            .with_context(|| format!("writing the plot {}", path.display()))?;
        progress.line(&format!("plot written to {}", path.display()));
    }
    Ok(())
}

/// `qpip-bench nbd qd1`.
fn nbd_qd1(args: Qd1Args) -> Result<()> {
    let Qd1Args {
        json,
        repeat,
        size,
        runtime,
        bins,
        mount_arg,
        dir,
        net,
    } = args;
    let runtime = std::time::Duration::try_from_secs_f64(runtime)
        .with_context(|| format!("--runtime {runtime}: expected a number of seconds"))?;
    let (server_bin, mount_bin) = bins.resolve()?;
    let progress = progress::Progress::new("qpip-bench nbd qd1");
    let opts = qd1::Options {
        size,
        runtime,
        repeat,
        server_bin,
        mount_bin,
        mount_args: mount_arg,
        dir,
        netns: net,
    };
    let report = qd1::run_all(opts, &progress)?;
    emit(json, &report, qd1::table(&report), true)
}

/// `qpip-bench nbd sweep`.
fn nbd_sweep(args: SweepArgs) -> Result<()> {
    let SweepArgs {
        json,
        repeat,
        sizes,
        depths,
        point_size,
        point_time,
        server_bin,
        dir,
        plot_dir,
        no_plot,
        net,
    } = args;
    check_plot_dir(&plot_dir, no_plot)?;
    let progress = progress::Progress::new("qpip-bench nbd sweep");
    let opts = sweep::Options {
        repeat,
        sizes,
        depths,
        point_size,
        point_time: std::time::Duration::from_secs_f64(point_time),
        server_bin: server_bin.map_or_else(peers::default_server_bin, Ok)?,
        dir,
        netns: net,
    };
    let report = sweep::run_all(opts, &progress)?;
    emit(json, &report, sweep::table(&report), true)?;
    if !no_plot {
        for (dir, path) in [
            ("write", plot_dir.join("qpip-bench-sweep-write.svg")),
            ("read", plot_dir.join("qpip-bench-sweep-read.svg")),
        ] {
            plot::sweep(&report, dir, &path)
                .with_context(|| format!("writing the plot {}", path.display()))?;
            progress.line(&format!("plot written to {}", path.display()));
        }
    }
    Ok(())
}
