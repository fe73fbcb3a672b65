//! What the QPIP binaries share, kept out of the libraries so that none of them needs a
//! command-line dependency: the options that choose the NIC for every binary that opens a
//! [`Nic`](qpip_core::Nic) (`--backend soft|lanai`, `--lanai-node`, `--lanai-fabric`,
//! `--lanai-params`; flatten [`NicArgs`] into a clap parser), one logging convention
//! ([`logging`]), man pages from the clap definitions ([`man`]), writing files such as
//! `--pid-file` where others may plant symlinks ([`files`]), sizes as the command lines take
//! them ([`size`]), other tools' options refused by name ([`refused`]), standard output that a reader may close early ([`stdout`]), and the
//! `qpip-lanai-bridge` binary.

pub mod files;
pub mod logging;
pub mod man;
pub mod refused;
pub mod size;
pub mod stdout;

use std::net::Ipv6Addr;
use std::path::PathBuf;

use qpip_core::lanai::ParamsError;
use qpip_core::{LanaiConfig, NicChoice};

/// Which NIC to run on (`--backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NicKind {
    /// The software NIC over the kernel's TCP/UDP sockets.
    #[default]
    Soft,
    /// The QPIP firmware on an emulated LANai 9 and Myrinet fabric (IPv6 only).
    Lanai,
}

impl NicKind {
    /// The backend's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            NicKind::Soft => "soft",
            NicKind::Lanai => "lanai",
        }
    }
}

/// The options that choose the NIC.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct NicArgs {
    /// NIC backend: the software NIC, or the QPIP firmware on an emulated LANai 9 NIC
    /// (IPv6 only; addresses and routes come from the fabric config).
    #[arg(
        long = "backend",
        value_name = "BACKEND",
        global = true,
        value_enum,
        default_value_t = NicKind::Soft
    )]
    pub kind: NicKind,
    /// With --backend lanai: this machine's node in the fabric config. Default: "server"
    /// for servers, the first other node whose fabric port is free for clients.
    #[arg(long, global = true, value_name = "NAME")]
    pub lanai_node: Option<String>,
    /// With --backend lanai: the fabric config (nodes, routes, ports). Default: the
    /// embedded configs/fabric.toml.
    #[arg(long, global = true, value_name = "FILE")]
    pub lanai_fabric: Option<PathBuf>,
    /// With --backend lanai: the device and cost model. Default: the embedded
    /// configs/lanai.toml.
    #[arg(long, global = true, value_name = "FILE")]
    pub lanai_params: Option<PathBuf>,
    /// Queues of the software NIC (engine threads, each owning the connections placed on
    /// it, the least loaded taking each new one), 1 to 256. Default: one per core, at
    /// least 8 when waiting threads run their queues (run to completion, the default) so
    /// that connections do not share one (QPIP_SOFT_QUEUES overrides it). The LANai NIC
    /// has one processor and one queue.
    #[arg(long, global = true, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub nic_queues: Option<u16>,
}

/// Why the NIC options cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NicArgsError {
    /// The LANai parameters file is wrong.
    #[error(transparent)]
    Params(#[from] ParamsError),
    /// LANai options with the soft NIC.
    #[error("--lanai-node, --lanai-fabric and --lanai-params need --backend lanai")]
    LanaiOptionsWithoutLanai,
    /// More than one queue asked of the LANai NIC.
    #[error("--nic-queues {0}: the LANai NIC has one queue (its one processor)")]
    LanaiQueues(u16),
    /// `--lanai-node` names no node of the fabric.
    #[error("the fabric has no node named {name:?} (its nodes: {})", nodes.join(", "))]
    UnknownNode {
        /// The name given.
        name: String,
        /// The fabric's nodes.
        nodes: Vec<String>,
    },
}

impl NicArgs {
    /// The LANai backend was chosen.
    pub fn is_lanai(&self) -> bool {
        self.kind == NicKind::Lanai
    }

    /// The NIC to open. `default_node` is the lanai node when `--lanai-node` is not
    /// given (servers pass `Some("server")`, clients `None`: the first free node).
    pub fn choice(&self, default_node: Option<&str>) -> Result<NicChoice, NicArgsError> {
        match self.kind {
            NicKind::Soft => {
                if self.lanai_node.is_some()
                    || self.lanai_fabric.is_some()
                    || self.lanai_params.is_some()
                {
                    return Err(NicArgsError::LanaiOptionsWithoutLanai);
                }
                let mut cfg = qpip_core::SoftConfig::default();
                if let Some(n) = self.nic_queues {
                    cfg.queues = n.into();
                }
                Ok(NicChoice::Soft(cfg))
            }
            NicKind::Lanai => match self.nic_queues {
                Some(n) if n > 1 => Err(NicArgsError::LanaiQueues(n)),
                _ => Ok(NicChoice::Lanai(self.lanai_config(default_node)?)),
            },
        }
    }

    /// The lanai configuration these options name (whatever `--backend` says).
    pub fn lanai_config(&self, default_node: Option<&str>) -> Result<LanaiConfig, NicArgsError> {
        let cfg = LanaiConfig::from_options(
            self.lanai_node.as_deref().or(default_node),
            self.lanai_fabric.as_deref(),
            self.lanai_params.as_deref(),
        )?;
        if let Some(name) = &cfg.node
            && cfg.fabric.node(name).is_none()
        {
            return Err(NicArgsError::UnknownNode {
                name: name.clone(),
                nodes: cfg.fabric.node.iter().map(|n| n.name.clone()).collect(),
            });
        }
        Ok(cfg)
    }

    /// With `--backend lanai`: the IPv6 address of the node (`--lanai-node` or
    /// `default_node`), for default listen addresses.
    pub fn lanai_addr(&self, default_node: &str) -> Result<Option<Ipv6Addr>, NicArgsError> {
        if !self.is_lanai() {
            return Ok(None);
        }
        let cfg = self.lanai_config(Some(default_node))?;
        Ok(cfg
            .node
            .as_deref()
            .and_then(|n| cfg.fabric.node(n))
            .map(|n| n.addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        nic: NicArgs,
    }

    #[test]
    fn soft_is_the_default_and_lanai_options_need_lanai() {
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert!(matches!(cli.nic.choice(None), Ok(NicChoice::Soft(_))));
        let cli = Cli::try_parse_from(["x", "--lanai-node", "client"]).unwrap();
        assert!(matches!(
            cli.nic.choice(None),
            Err(NicArgsError::LanaiOptionsWithoutLanai)
        ));
    }

    #[test]
    fn nic_queues_set_the_soft_nic_s_queues_and_are_refused_for_lanai() {
        let cli = Cli::try_parse_from(["x", "--nic-queues", "3"]).unwrap();
        let Ok(NicChoice::Soft(cfg)) = cli.nic.choice(None) else {
            panic!("soft backend expected");
        };
        assert_eq!(cfg.queues, 3);
        assert!(Cli::try_parse_from(["x", "--nic-queues", "0"]).is_err());
        let cli = Cli::try_parse_from(["x", "--backend", "lanai", "--nic-queues", "2"]).unwrap();
        let e = cli.nic.choice(None).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("--nic-queues 2"), "{e}");
    }

    #[test]
    fn lanai_nodes_default_per_role_and_unknown_ones_are_named() {
        let cli = Cli::try_parse_from(["x", "--backend", "lanai"]).unwrap();
        let Ok(NicChoice::Lanai(cfg)) = cli.nic.choice(Some("server")) else {
            panic!("lanai backend expected");
        };
        assert_eq!(cfg.node.as_deref(), Some("server"));
        assert_eq!(
            cli.nic.lanai_addr("server").unwrap(),
            Some("fd00:4c41:4e41::1".parse().unwrap())
        );
        let err = |args: &[&str]| {
            let cli = Cli::try_parse_from(["x", "--backend", "lanai"].iter().chain(args)).unwrap();
            cli.nic.choice(None).map(|_| ()).unwrap_err().to_string()
        };
        let e = err(&["--lanai-node", "zz"]);
        assert!(e.contains("\"zz\""), "{e}");
        let e = err(&["--lanai-fabric", "/nonexistent.toml"]);
        assert!(e.contains("/nonexistent.toml"), "{e}");
    }
}
