//! The firmware's network port as a smoltcp `phy::Device`: the receive token is the one frame
//! being received; transmit tokens build Myrinet frames, charge the transmit stages and queue
//! them for the send DMA.

use std::cell::Cell;
use std::collections::VecDeque;
use std::net::Ipv6Addr;

use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

use super::OutFrame;
use super::staging::SendStaging;
use crate::frame;
use crate::meter::{Dir, Kind, Meter, Nanos, Stage};
use crate::params::FabricParams;
use crate::pci::{PciBus, Use};

/// IPv6 header bytes (smoltcp adds no extension headers to TCP or UDP).
const IPV6_HEADER: usize = 40;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;

pub(super) fn instant(n: Nanos) -> Instant {
    Instant::from_micros(i64::try_from(n / 1000).unwrap_or(i64::MAX))
}

pub(super) fn nanos(i: Instant) -> Nanos {
    u64::try_from(i.total_micros()).unwrap_or(0) * 1000
}

thread_local! {
    /// The clock RFC 1323 timestamps read: smoltcp takes a plain `fn`, so the firmware sets
    /// this (in ms of its own clock) before each poll; virtual time stays deterministic.
    static TSVAL_MS: Cell<u32> = const { Cell::new(0) };
}

pub(super) fn set_tsval_clock(now: Nanos) {
    // Wraps after 49 days, as TCP timestamps do.
    TSVAL_MS.with(|c| c.set((now / 1_000_000) as u32));
}

pub(super) fn tsval() -> u32 {
    TSVAL_MS.with(Cell::get)
}

/// What an IPv6 packet carries, as far as the cost model cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Carried {
    Tcp { payload: usize },
    Udp { payload: usize },
    Other,
}

impl Carried {
    /// Data or bare ACK (a TCP segment with payload is data; every datagram is data).
    pub(super) fn kind(self) -> Kind {
        match self {
            Carried::Tcp { payload: 0 } | Carried::Other => Kind::Ack,
            Carried::Tcp { .. } | Carried::Udp { .. } => Kind::Data,
        }
    }
    pub(super) fn payload(self) -> usize {
        match self {
            Carried::Tcp { payload } | Carried::Udp { payload } => payload,
            Carried::Other => 0,
        }
    }
}

/// Destination and contents of an IPv6 packet; `None` if it is not one.
pub(super) fn classify(pkt: &[u8]) -> Option<(Ipv6Addr, Carried)> {
    if pkt.len() < IPV6_HEADER || pkt[0] >> 4 != 6 {
        return None;
    }
    let dst: [u8; 16] = pkt[24..40].try_into().ok()?;
    let body = &pkt[IPV6_HEADER..];
    let carried = match pkt[6] {
        PROTO_TCP if body.len() >= 20 => {
            let hdr = usize::from(body[12] >> 4) * 4;
            Carried::Tcp {
                payload: body.len().saturating_sub(hdr),
            }
        }
        PROTO_UDP if body.len() >= 8 => Carried::Udp {
            payload: body.len() - 8,
        },
        _ => Carried::Other,
    };
    Some((Ipv6Addr::from(dst), carried))
}

/// What the transmit side of the port needs from the firmware.
pub(super) struct Wire<'a> {
    pub meter: &'a mut Meter,
    pub out: &'a mut VecDeque<OutFrame>,
    pub fabric: &'a FabricParams,
    pub bus: &'a mut PciBus,
    pub staging: &'a mut SendStaging,
    pub no_route: &'a mut u64,
}

pub(super) struct Port<'a> {
    /// The IPv6 packet being received, until smoltcp takes it.
    pub rx: Option<&'a [u8]>,
    pub wire: Wire<'a>,
}

pub(super) struct Rx<'b>(&'b [u8]);

pub(super) struct Tx<'b, 'a>(&'b mut Wire<'a>);

impl<'a> phy::Device for Port<'a> {
    type RxToken<'b>
        = Rx<'b>
    where
        Self: 'b;
    type TxToken<'b>
        = Tx<'b, 'a>
    where
        Self: 'b;

    fn receive(&mut self, _: Instant) -> Option<(Rx<'_>, Tx<'_, 'a>)> {
        let pkt = self.rx.take()?;
        Some((Rx(pkt), Tx(&mut self.wire)))
    }

    /// Store and forward: nothing is built while every staging buffer is taken.
    fn transmit(&mut self, _: Instant) -> Option<Tx<'_, 'a>> {
        let now = self.wire.meter.now();
        self.wire
            .staging
            .has_room(now)
            .then_some(Tx(&mut self.wire))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = self.wire.fabric.mtu;
        caps
    }
}

impl phy::RxToken for Rx<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(self.0)
    }
}

impl phy::TxToken for Tx<'_, '_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut pkt = vec![0u8; len];
        let r = f(&mut pkt);
        self.0.send(&pkt);
        r
    }
}

impl Wire<'_> {
    /// The transmit stages for one packet: schedule, data from the host into a staging
    /// buffer (the DMA also produces the TCP/UDP checksum), then the headers, which need
    /// that checksum, the hand-off to the network send DMA and the state update.
    fn send(&mut self, pkt: &[u8]) {
        let Some((dst, carried)) = classify(pkt) else {
            tracing::debug!("lanai: smoltcp emitted a non-IPv6 packet; dropped");
            return;
        };
        let Some(route) = self.fabric.route_to(&dst) else {
            *self.no_route += 1;
            tracing::debug!(%dst, "lanai: no route; packet dropped");
            return;
        };
        let kind = carried.kind();
        let m = &mut *self.meter;
        let taken = m.now();
        m.count_packet(Dir::Send, kind);
        m.charge(Dir::Send, kind, Stage::Schedule, 0);
        let mut summed = m.now();
        if carried.payload() > 0 {
            m.charge(Dir::Send, kind, Stage::GetData, 0);
            summed = self.bus.dma_now(Use::Read, m, carried.payload());
        }
        let header = match carried {
            Carried::Udp { .. } => Stage::BuildUdpHeader,
            _ => Stage::BuildTcpHeader,
        };
        // The processor does not wait for the DMA (it serves other work meanwhile), but the
        // header stages of this packet cannot start before its checksum exists.
        let before = m.now();
        m.charge(Dir::Send, kind, header, 0);
        m.charge(Dir::Send, kind, Stage::BuildIpHeader, 0);
        m.charge(Dir::Send, kind, Stage::Send, 0);
        let ready_at = m.now().max(summed + (m.now() - before));
        m.charge(Dir::Send, kind, Stage::Update, 0);
        let bytes = frame::encode(route, pkt);
        // The link decides when it leaves (stop/go); it reports the tail back (`link_done`).
        self.staging.stage(taken);
        self.out.push_back(OutFrame { bytes, ready_at });
    }
}
