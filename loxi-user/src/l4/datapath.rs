//! The loaded XDP object: attachment (native with generic fallback, plus the TC ingress
//! program that completes forwarding to egresses without XDP receive; or, for `--tc-iface`,
//! the whole data path in TC ingress), map programming from a
//! [`Plan`], the XDP-capable egress set, counter reads and `BPF_PROG_TEST_RUN`.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Instant,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, DevMapHash, HashMap, MapData, PerCpuArray},
    programs::{
        ProgramType, SchedClassifier, TcAttachType, TestRun, TestRunOptions, Xdp, XdpMode,
        tc::SchedClassifierLinkId, xdp::XdpLinkId,
    },
    sys::{BpfHelper, is_helper_supported},
};
use loxi_common::maps::{
    CT_ENTRIES, CtKey, CtValue, EndpointValue, MAP_ACTIVE, MAP_CONNTRACK, MAP_COUNTERS,
    MAP_EGRESS_PEER, MAP_EGRESS_XDP, MAP_ENDPOINTS, MAP_REPLY_VIP, MAP_SERVICES, MAP_WRR, MAX_EPS,
    PROG_NAME, ServiceKey, ServiceValue, TC_FULL_PROG_NAME, TC_PROG_NAME, WRR_SLOTS, ctr,
    egress::GLOBAL_META_OK,
};

use super::{
    L4Error, Plan, object_bytes,
    reply::{self, ReplyVipTable},
};

/// How the program ended up attached to an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// Driver (native) XDP.
    Native,
    /// Generic (skb) XDP, after native was refused.
    Generic,
    /// The whole data path in TC ingress (`--tc-iface`, [`TC_FULL_PROG_NAME`]).
    Tc,
}

impl AttachMode {
    /// Metric / log label: `native`, `generic` or `tc`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
            Self::Tc => "tc",
        }
    }
}

/// A loaded data path. Dropping it detaches every attachment (links are fd-based).
pub struct Datapath {
    ebpf: Ebpf,
    /// Whether the hand-off to TC carries XDP metadata ([`xdp_metadata_allowed`]).
    meta_ok: bool,
    links: Vec<(String, XdpLinkId, AttachMode)>,
    tc_links: Vec<(String, SchedClassifierLinkId)>,
    /// `--tc-iface` attachments of [`TC_FULL_PROG_NAME`], with the interface's index then.
    full_links: Vec<(String, SchedClassifierLinkId, u32)>,
    /// Ifindexes in `LOXI_EGRESS_XDP`.
    xdp_egress: MapKeys,
    /// Ifindexes in `LOXI_EGRESS_PEER`.
    peer_egress: MapKeys,
    /// Service keys currently in the map, with their endpoint count.
    installed: BTreeMap<[u8; 20], (ServiceKey, ServiceValue)>,
    /// What `LOXI_REPLY_VIP` holds ([`super::reply`]).
    reply_vips: ReplyVipTable,
    /// The kernel's id of the loaded XDP program (fixed once loaded).
    prog_id: u32,
    /// The kernel's id of the loaded [`TC_FULL_PROG_NAME`] program.
    full_prog_id: u32,
    /// Most entries one loader walk of the conntrack map reads ([`WALK_BOUND`]; tests lower
    /// it to cut walks off).
    walk_bound: usize,
}

/// Whether this kernel lets XDP programs call `bpf_xdp_adjust_meta` (aya's probe, libbpf's
/// method: a two-instruction program calling it). Linux 6.18 as this project's VMs run it
/// does not ("program of this type cannot use helper"); a failed probe counts as no.
fn xdp_metadata_allowed() -> bool {
    match is_helper_supported(ProgramType::Xdp, BpfHelper::BPF_FUNC_xdp_adjust_meta) {
        Ok(ok) => ok,
        Err(e) => {
            tracing::warn!(error = %e, "probing bpf_xdp_adjust_meta failed; handing off without metadata");
            false
        }
    }
}

/// Most entries a loader walk of the conntrack map reads: twice the map's capacity (deletes
/// under a busy map restart the kernel's walk). A walk that reaches it is cut off and proves
/// no absence.
const WALK_BOUND: usize = 2 * CT_ENTRIES as usize;

/// Runs a program load again, up to 5 times in all, while the kernel answers EAGAIN: its
/// verifier gives up with EAGAIN when a signal is pending for the loading thread (a child
/// process's SIGCHLD, say), and the same load then passes. libbpf retries its loads the same
/// way (`sys_bpf_prog_load`, 5 attempts); aya 0.14 retries only for a larger verifier log.
fn retry_interrupted(
    mut load: impl FnMut() -> Result<(), aya::programs::ProgramError>,
) -> Result<(), aya::programs::ProgramError> {
    let mut attempt = 1;
    loop {
        match load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if io_error.kind() == std::io::ErrorKind::WouldBlock && attempt < 5 =>
            {
                tracing::debug!(attempt, "BPF_PROG_LOAD interrupted (EAGAIN): loading again");
                attempt += 1;
            }
            other => return other,
        }
    }
}

impl Datapath {
    /// Loads the embedded object and its program into the kernel (needs CAP_BPF / root).
    pub fn load() -> Result<Self, L4Error> {
        let bytes = object_bytes();
        if bytes.is_empty() {
            return Err(L4Error::NoObject);
        }
        let meta_ok = xdp_metadata_allowed();
        let mut ebpf = EbpfLoader::new()
            .override_global(GLOBAL_META_OK, &u8::from(meta_ok), true)
            .load(bytes)
            .map_err(|e| L4Error::Load(Box::new(e)))?;
        let prog = xdp(&mut ebpf)?;
        retry_interrupted(|| prog.load()).map_err(|e| L4Error::program("load", e))?;
        let prog_id = prog
            .info()
            .map_err(|e| L4Error::program("program info", e))?
            .id();
        let hand_off = tc(&mut ebpf)?;
        retry_interrupted(|| hand_off.load()).map_err(|e| L4Error::program("load TC", e))?;
        let full = tc_full(&mut ebpf)?;
        retry_interrupted(|| full.load())
            .map_err(|e| L4Error::program("load the TC data path", e))?;
        let full_prog_id = full
            .info()
            .map_err(|e| L4Error::program("TC data path info", e))?
            .id();
        Ok(Self {
            ebpf,
            meta_ok,
            links: Vec::new(),
            tc_links: Vec::new(),
            full_links: Vec::new(),
            xdp_egress: MapKeys::default(),
            peer_egress: MapKeys::default(),
            installed: BTreeMap::new(),
            reply_vips: ReplyVipTable::default(),
            prog_id,
            full_prog_id,
            walk_bound: WALK_BOUND,
        })
    }

    /// Attaches to `iface`: native first, generic if the driver refuses (or if `force_generic`).
    /// The first XDP attachment on a kernel that refuses XDP metadata says how the hand-off
    /// works instead (a daemon with only `--tc-iface` has none, and no warning).
    pub fn attach(&mut self, iface: &str, force_generic: bool) -> Result<AttachMode, L4Error> {
        if !self.meta_ok && self.links.is_empty() {
            tracing::warn!(
                "this kernel refuses bpf_xdp_adjust_meta to XDP programs: frames for egresses \
                 without XDP receive are handed to the TC program without metadata and \
                 recognised by their next-hop MACs (a FIB lookup per such frame in TC)"
            );
        }
        let prog = xdp(&mut self.ebpf)?;
        let first = if force_generic {
            XdpMode::Skb
        } else {
            XdpMode::Driver
        };
        let (id, mode) = match prog.attach(iface, first) {
            Ok(id) if force_generic => (id, AttachMode::Generic),
            Ok(id) => (id, AttachMode::Native),
            Err(aya::programs::ProgramError::UnknownInterface { name }) => {
                return Err(L4Error::NoInterface(name));
            }
            Err(native) => {
                tracing::warn!(iface, error = %native, "native XDP refused, trying generic");
                let id = prog
                    .attach(iface, XdpMode::Skb)
                    .map_err(|e| L4Error::program(format!("attach to {iface}"), e))?;
                (id, AttachMode::Generic)
            }
        };
        tracing::info!(iface, mode = mode.as_str(), "XDP data path attached");
        self.links.push((iface.to_string(), id, mode));
        let tc_id = tc(&mut self.ebpf)?
            .attach(iface, TcAttachType::Ingress)
            .map_err(|e| L4Error::program(format!("attach TC ingress to {iface}"), e))?;
        self.tc_links.push((iface.to_string(), tc_id));
        Ok(mode)
    }

    /// Attaches the whole data path to `iface`'s TC ingress ([`TC_FULL_PROG_NAME`], TCX on
    /// Linux ≥ 6.6, else a `clsact` filter); `ifindex` is the interface's index now, kept to
    /// notice a recreated interface ([`Self::tc_attached`]).
    ///
    /// Errors: [`L4Error::TcTaken`] when the interface already carries a `loxi_tc_full` program
    /// this loader did not attach (another loxilb on it: TCX would run both, and only the first
    /// one's rules would serve).
    pub fn attach_tc(&mut self, iface: &str, ifindex: u32) -> Result<AttachMode, L4Error> {
        if let Ok((_, progs)) = SchedClassifier::query_tcx(iface, TcAttachType::Ingress)
            && let Some(other) = progs
                .iter()
                .find(|p| p.id() != self.full_prog_id && p.name_as_str() == Some(TC_FULL_PROG_NAME))
        {
            return Err(L4Error::TcTaken {
                iface: iface.to_string(),
                prog_id: other.id(),
            });
        }
        let id = match tc_full(&mut self.ebpf)?.attach(iface, TcAttachType::Ingress) {
            Ok(id) => id,
            Err(aya::programs::ProgramError::UnknownInterface { name }) => {
                return Err(L4Error::NoInterface(name));
            }
            Err(e) => {
                return Err(L4Error::program(
                    format!("attach the TC data path to {iface}"),
                    e,
                ));
            }
        };
        tracing::info!(iface, mode = "tc", "L4 data path attached in TC ingress");
        self.full_links.push((iface.to_string(), id, ifindex));
        Ok(AttachMode::Tc)
    }

    /// Whether `iface` (index `ifindex` now) still carries the TC data path: attached by this
    /// loader to the interface of that index and, where the kernel lists TCX programs, still
    /// among them (a program detached from outside is not).
    pub fn tc_attached(&self, iface: &str, ifindex: u32) -> bool {
        let ours = self
            .full_links
            .iter()
            .any(|(i, _, idx)| i == iface && *idx == ifindex);
        if !ours {
            return false;
        }
        match SchedClassifier::query_tcx(iface, TcAttachType::Ingress) {
            Ok((_, progs)) => progs.iter().any(|p| p.id() == self.full_prog_id),
            // Before TCX (Linux < 6.6) the filter is a netlink object: its index check above
            // is what is known.
            Err(_) => true,
        }
    }

    /// Whether frames for egresses without XDP receive reach the TC program with loxi's
    /// metadata in front (`loxi_common::maps::egress::Meta`), or without it, known by their
    /// MACs (a kernel that refuses `bpf_xdp_adjust_meta` to XDP programs).
    pub fn hands_off_with_metadata(&self) -> bool {
        self.meta_ok
    }

    /// The kernel's id of the loaded XDP program: what a link's `IFLA_XDP_*PROG_ID` attributes
    /// name when the program is attached to it.
    pub fn xdp_prog_id(&self) -> u32 {
        self.prog_id
    }

    /// Drops `iface`'s XDP and TC attachments, after its device went away or lost the program:
    /// detaching is tried and its failure only logged at debug, since the kernel removed the
    /// attachment with the device. Returns the mode it was attached in, if it was.
    pub fn forget(&mut self, iface: &str) -> Option<AttachMode> {
        let gone = take_where(&mut self.links, |(i, _, _)| i == iface);
        let mode = gone.last().map(|(_, _, m)| *m);
        if let Ok(prog) = xdp(&mut self.ebpf) {
            for (_, id, _) in gone {
                if let Err(e) = prog.detach(id) {
                    tracing::debug!(iface, error = %e, "detaching a stale XDP attachment");
                }
            }
        }
        let gone = take_where(&mut self.tc_links, |(i, _)| i == iface);
        if let Ok(prog) = tc(&mut self.ebpf) {
            for (_, id) in gone {
                if let Err(e) = prog.detach(id) {
                    tracing::debug!(iface, error = %e, "detaching a stale TC attachment");
                }
            }
        }
        let gone = take_where(&mut self.full_links, |(i, _, _)| i == iface);
        let mode = mode.or(gone.last().map(|_| AttachMode::Tc));
        if let Ok(prog) = tc_full(&mut self.ebpf) {
            for (_, id, _) in gone {
                if let Err(e) = prog.detach(id) {
                    tracing::debug!(iface, error = %e, "detaching a stale TC data path attachment");
                }
            }
        }
        mode
    }

    /// Interfaces attached in native (driver) mode.
    pub fn native_ifaces(&self) -> BTreeSet<String> {
        self.links
            .iter()
            .filter(|(_, _, m)| *m == AttachMode::Native)
            .map(|(i, _, _)| i.clone())
            .collect()
    }

    /// Makes `LOXI_EGRESS_XDP` hold exactly `want` (see [`super::egress`]); logs each change.
    pub fn set_xdp_egress(&mut self, want: &BTreeSet<u32>) -> Result<(), L4Error> {
        if self.xdp_egress.is(want) {
            return Ok(());
        }
        let mut map: DevMapHash<&mut MapData> = DevMapHash::try_from(
            self.ebpf
                .map_mut(MAP_EGRESS_XDP)
                .ok_or(L4Error::MissingMap(MAP_EGRESS_XDP))?,
        )
        .map_err(|e| L4Error::map(MAP_EGRESS_XDP, e))?;
        set_keys(&mut map, MAP_EGRESS_XDP, &mut self.xdp_egress, want)?;
        tracing::info!(
            ifindexes = ?want,
            "egress interfaces taking XDP frames (others get the TC hand-off)"
        );
        Ok(())
    }

    /// Makes `LOXI_EGRESS_PEER` hold exactly `want` (veths whose peer is in another namespace,
    /// [`super::egress::peer_elsewhere`]); logs each change.
    pub fn set_peer_egress(&mut self, want: &BTreeSet<u32>) -> Result<(), L4Error> {
        if self.peer_egress.is(want) {
            return Ok(());
        }
        let m = self
            .ebpf
            .map_mut(MAP_EGRESS_PEER)
            .ok_or(L4Error::MissingMap(MAP_EGRESS_PEER))?;
        let mut map: HashMap<&mut MapData, u32, u8> =
            HashMap::try_from(m).map_err(|e| L4Error::map(MAP_EGRESS_PEER, e))?;
        set_keys(&mut map, MAP_EGRESS_PEER, &mut self.peer_egress, want)?;
        tracing::info!(
            ifindexes = ?want,
            "egress veths with their peer in another namespace (the TC data path sends with bpf_redirect_peer)"
        );
        Ok(())
    }

    /// Interfaces attached so far with their modes (XDP, then TC).
    pub fn attachments(&self) -> impl Iterator<Item = (&str, AttachMode)> {
        self.links.iter().map(|(i, _, m)| (i.as_str(), *m)).chain(
            self.full_links
                .iter()
                .map(|(i, _, _)| (i.as_str(), AttachMode::Tc)),
        )
    }

    /// Detaches every attachment.
    pub fn detach_all(&mut self) -> Result<(), L4Error> {
        let full_links = std::mem::take(&mut self.full_links);
        let prog = tc_full(&mut self.ebpf)?;
        for (iface, id, _) in full_links {
            prog.detach(id).map_err(|e| {
                L4Error::program(format!("detach the TC data path from {iface}"), e)
            })?;
            tracing::info!(iface = %iface, "TC data path detached");
        }
        let tc_links = std::mem::take(&mut self.tc_links);
        let prog = tc(&mut self.ebpf)?;
        for (iface, id) in tc_links {
            prog.detach(id)
                .map_err(|e| L4Error::program(format!("detach TC from {iface}"), e))?;
        }
        let links = std::mem::take(&mut self.links);
        let prog = xdp(&mut self.ebpf)?;
        for (iface, id, _) in links {
            prog.detach(id)
                .map_err(|e| L4Error::program(format!("detach from {iface}"), e))?;
            tracing::info!(iface = %iface, "XDP data path detached");
        }
        Ok(())
    }

    /// Makes the maps match `plan`. Removed services go first (so a slot freed and reused in
    /// the same snapshot is not wiped after its new owner wrote it); then, per service, its
    /// endpoint rows and tables are written before the service entry that makes them live.
    /// Rows are only cleared in slots no planned service uses (or past a shrunk `nep`).
    /// Conntrack is left alone, so established flows keep their endpoint. Last, the reply-VIP
    /// table follows the plan ([`Self::sync_reply_vips`]).
    pub fn apply(&mut self, plan: &Plan) -> Result<(), L4Error> {
        let used: BTreeSet<u32> = plan.services.values().map(|s| s.value.slot).collect();
        let gone: Vec<[u8; 20]> = self
            .installed
            .keys()
            .filter(|k| !plan.services.contains_key(*k))
            .copied()
            .collect();
        for kb in gone {
            if let Some((key, value)) = self.installed.remove(&kb) {
                match self.services()?.remove(&key) {
                    Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                    Err(e) => return Err(L4Error::map(MAP_SERVICES, e)),
                }
                if !used.contains(&value.slot) {
                    self.clear_rows(value.slot, 0, value.nep as u32)?;
                }
            }
        }
        for (kb, svc) in &plan.services {
            let slot = svc.value.slot;
            {
                let mut eps = self.endpoints()?;
                for (i, e) in svc.endpoints.iter().enumerate() {
                    eps.set(slot * MAX_EPS + i as u32, e, 0)
                        .map_err(|e| L4Error::map(MAP_ENDPOINTS, e))?;
                }
            }
            self.table(MAP_WRR)?
                .set(slot, svc.wrr, 0)
                .map_err(|e| L4Error::map(MAP_WRR, e))?;
            self.table(MAP_ACTIVE)?
                .set(slot, svc.active, 0)
                .map_err(|e| L4Error::map(MAP_ACTIVE, e))?;
            self.services()?
                .insert(svc.key, svc.value, 0)
                .map_err(|e| L4Error::map(MAP_SERVICES, e))?;
            if let Some((_, old)) = self.installed.insert(*kb, (svc.key, svc.value)) {
                if old.slot == slot {
                    self.clear_rows(slot, svc.value.nep as u32, old.nep as u32)?;
                } else if !used.contains(&old.slot) {
                    self.clear_rows(old.slot, 0, old.nep as u32)?;
                }
            }
        }
        self.sync_reply_vips(plan, Instant::now())
    }

    /// Brings `LOXI_REPLY_VIP` towards `plan` at time `now` ([`ReplyVipTable::step`]):
    /// - adds an entry for each new DNAT endpoint that one VIP reaches, unless conntrack holds
    ///   a live flow between it and another VIP ([`reply::is_foreign`]; then retried after
    ///   [`reply::RETRY_AFTER`]; one walk of the conntrack map for all of them);
    /// - for each entry unwanted for [`reply::RETIRE_AFTER`] (at once for one another VIP now
    ///   shares), inserts the reply entry of every deferred flow of that pair still without one
    ///   (one walk for all of them), deletes the entry, and walks again for the flows that
    ///   deferred during the first walk. A first walk cut off by its bound retires nothing
    ///   (offered again at the next call); a second walk cut off puts the entries back, so the
    ///   replies of flows it did not reach still find their VIP, and they are offered again.
    ///
    /// Also called every stats tick, so retirements happen without rule changes. A full
    /// map is not an error: that endpoint's flows insert both entries.
    ///
    /// Errors: [`L4Error::Map`] when a map cannot be read or written (the table keeps what
    /// took; the next call retries the rest).
    pub fn sync_reply_vips(&mut self, plan: &Plan, now: Instant) -> Result<(), L4Error> {
        let steps = self.reply_vips.step(plan, now);
        if !steps.retire.is_empty() {
            self.retire_reply_vips(&steps.retire)?;
        }
        let blocked = self.foreign_flows(&steps.insert)?;
        for ((ep, _), _) in steps.insert.iter().zip(&blocked).filter(|(_, b)| **b) {
            tracing::debug!(
                endpoint = %super::plan::addr_ip(ep.family, &ep.addr),
                port = u16::from_be(ep.port),
                "reply-VIP entry waits for another VIP's flows to the endpoint to end"
            );
            self.reply_vips.wait(ep, now);
        }
        for ((ep, vip), _) in steps.insert.into_iter().zip(blocked).filter(|(_, b)| !b) {
            match self.reply_vip_map()?.insert(ep, vip, 0) {
                Ok(()) => self.reply_vips.inserted(ep, vip),
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::E2BIG) =>
                {
                    tracing::debug!(
                        "reply-VIP map full: this endpoint's flows insert both entries"
                    );
                    // Offered again after the retry delay, not walked for at every tick.
                    self.reply_vips.wait(&ep, now);
                }
                Err(e) => return Err(L4Error::map(MAP_REPLY_VIP, e)),
            }
        }
        Ok(())
    }

    /// Retires `pairs` from `LOXI_REPLY_VIP` (see [`Self::sync_reply_vips`]).
    fn retire_reply_vips(&mut self, pairs: &[(ServiceKey, ServiceKey)]) -> Result<(), L4Error> {
        let Some(mut added) = self.add_deferred_replies(pairs)? else {
            tracing::debug!("conntrack walk cut off: reply-VIP entries kept for the next try");
            return Ok(());
        };
        for (ep, _) in pairs {
            match self.reply_vip_map()?.remove(ep) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(L4Error::map(MAP_REPLY_VIP, e)),
            }
        }
        // A pair retired at once still had its VIP's new flows deferring while the first walk
        // ran: the second walk, after the delete, gives those their reply entries.
        let Some(more) = self.add_deferred_replies(pairs)? else {
            for (ep, vip) in pairs {
                self.reply_vip_map()?
                    .insert(ep, vip, 0)
                    .map_err(|e| L4Error::map(MAP_REPLY_VIP, e))?;
            }
            tracing::debug!("conntrack walk cut off: reply-VIP entries put back for the next try");
            return Ok(());
        };
        added += more;
        for (ep, _) in pairs {
            self.reply_vips.retired(ep);
        }
        tracing::debug!(
            retired = pairs.len(),
            reply_entries_added = added,
            "reply-VIP entries retired"
        );
        Ok(())
    }

    /// Sets the bound of the loader's conntrack walks (tests: a cut-off walk).
    #[cfg(test)]
    pub fn set_walk_bound(&mut self, bound: usize) {
        self.walk_bound = bound;
    }

    /// The (endpoint, VIP) pairs `LOXI_REPLY_VIP` holds, as the loader wrote them.
    pub fn reply_vip_pairs(&self) -> Vec<(ServiceKey, ServiceKey)> {
        self.reply_vips.pairs().collect()
    }

    /// For each (endpoint, VIP) pair, whether conntrack holds a live entry of a DNAT flow
    /// between that endpoint and another VIP ([`reply::is_foreign`]). One bounded walk of the
    /// map for all pairs; none for no pairs.
    fn foreign_flows(&mut self, pairs: &[(ServiceKey, ServiceKey)]) -> Result<Vec<bool>, L4Error> {
        let mut blocked = vec![false; pairs.len()];
        if pairs.is_empty() {
            return Ok(blocked);
        }
        // A second early: the program's coarse clock can lag this one by a tick, and an entry
        // it still finds live must count.
        let now = super::conntrack::monotonic_ns().saturating_sub(1_000_000_000);
        let complete = self.walk_live(now, |k, v| {
            for (b, (ep, vip)) in blocked.iter_mut().zip(pairs) {
                *b = *b || reply::is_foreign(k, v, ep, vip);
            }
        })?;
        if !complete {
            // Not a proof of absence: every pair waits.
            blocked.fill(true);
        }
        Ok(blocked)
    }

    /// Calls `f` with every conntrack entry live at `now` (ns, [`super::conntrack::monotonic_ns`]),
    /// reading at most the walk bound ([`WALK_BOUND`]) of entries; false when the walk was cut
    /// off by it (deletes under a busy map restart the kernel's walk), so it proves no absence.
    fn walk_live(
        &mut self,
        now: u64,
        mut f: impl FnMut(&CtKey, &CtValue),
    ) -> Result<bool, L4Error> {
        let bound = self.walk_bound;
        let ct: HashMap<&mut MapData, CtKey, CtValue> = self.hash_map(MAP_CONNTRACK)?;
        let mut walked = 0;
        for (k, v) in ct
            .iter()
            .take(bound)
            .inspect(|_| walked += 1)
            .filter_map(Result::ok)
        {
            if !super::conntrack::expired(&v, now) {
                f(&k, &v);
            }
        }
        Ok(walked < bound)
    }

    /// Inserts the reply entry of every live forward entry that `pairs` may have deferred and
    /// that has none yet; a leftover entry of an earlier flow under the same reply key (closed,
    /// expired, or another VIP's) is replaced, since the newest flow owns the key. Returns how
    /// many it inserted, or `None` when the walk was cut off by its bound ([`WALK_BOUND`]):
    /// the flows it reached have their entries then, but others may still lack theirs.
    fn add_deferred_replies(
        &mut self,
        pairs: &[(ServiceKey, ServiceKey)],
    ) -> Result<Option<usize>, L4Error> {
        let now = super::conntrack::monotonic_ns();
        // Collected first: inserting while walking could make the walk restart or skip.
        let mut replies: Vec<(CtKey, CtKey, CtValue)> = Vec::new();
        let complete = self.walk_live(now, |k, v| {
            if pairs
                .iter()
                .any(|(ep, vip)| reply::is_deferrable(k, v, ep, vip))
            {
                let (rk, rv) = reply::reply_entry(k, v);
                replies.push((*k, rk, rv));
            }
        })?;
        let mut ct: HashMap<&mut MapData, CtKey, CtValue> = self.hash_map(MAP_CONNTRACK)?;
        let mut added = 0;
        for (k, rk, rv) in replies {
            if let Ok(have) = ct.get(&rk, 0)
                && reply::is_reply_of(&have, &k)
                && !super::conntrack::expired(&have, now)
            {
                continue; // the data path inserted it at the flow's first reply
            }
            ct.insert(rk, rv, 0)
                .map_err(|e| L4Error::map(MAP_CONNTRACK, e))?;
            added += 1;
        }
        Ok(complete.then_some(added))
    }

    fn clear_rows(&mut self, slot: u32, from: u32, to: u32) -> Result<(), L4Error> {
        let mut eps = self.endpoints()?;
        for i in from..to.min(MAX_EPS) {
            eps.set(slot * MAX_EPS + i, EndpointValue::default(), 0)
                .map_err(|e| L4Error::map(MAP_ENDPOINTS, e))?;
        }
        Ok(())
    }

    /// Sum over CPUs of counter `idx` (`loxi_common::maps::ctr`).
    pub fn counter(&self, idx: u32) -> Result<u64, L4Error> {
        let map = self
            .ebpf
            .map(MAP_COUNTERS)
            .ok_or(L4Error::MissingMap(MAP_COUNTERS))?;
        let arr: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(map).map_err(|e| L4Error::map(MAP_COUNTERS, e))?;
        let v = arr
            .get(&idx, 0)
            .map_err(|e| L4Error::map(MAP_COUNTERS, e))?;
        Ok(v.iter().sum())
    }

    /// Kernel id of the conntrack map ([`loxi_common::maps::MAP_CONNTRACK`]), for
    /// [`super::ConntrackHandle::publish`].
    pub fn conntrack_map_id(&self) -> Result<u32, L4Error> {
        let map = self
            .ebpf
            .map(MAP_CONNTRACK)
            .ok_or(L4Error::MissingMap(MAP_CONNTRACK))?;
        let (aya::maps::Map::LruHashMap(d) | aya::maps::Map::HashMap(d)) = map else {
            return Err(L4Error::MissingMap(MAP_CONNTRACK));
        };
        Ok(d.info().map_err(|e| L4Error::map(MAP_CONNTRACK, e))?.id())
    }

    /// Packets and bytes of endpoint row (slot, ep).
    pub fn endpoint_counters(&self, slot: u32, ep: u32) -> Result<(u64, u64), L4Error> {
        let i = ctr::ep_packets(slot, ep);
        Ok((self.counter(i)?, self.counter(i + 1)?))
    }

    /// Runs the XDP program once on `frame` with `BPF_PROG_TEST_RUN`; returns (action, output).
    pub fn test_run(&mut self, frame: &[u8]) -> Result<(u32, Vec<u8>), L4Error> {
        test_run(xdp(&mut self.ebpf)?, frame, None)
    }

    /// Runs the TC data path ([`TC_FULL_PROG_NAME`]) once on `frame` as a socket buffer that
    /// arrived on interface `ingress` (`BPF_PROG_TEST_RUN` with a `__sk_buff` context naming it
    /// as `ifindex` and `ingress_ifindex`; the checksum state is `CHECKSUM_NONE`); returns (TC
    /// action, output).
    pub fn test_run_tc(&mut self, frame: &[u8], ingress: u32) -> Result<(u32, Vec<u8>), L4Error> {
        // `struct __sk_buff` up to `tc_index`: `ingress_ifindex` at byte 36, `ifindex` at 40
        // (include/uapi/linux/bpf.h); the kernel takes a context shorter than the struct.
        let mut ctx = [0u8; 44];
        ctx[36..40].copy_from_slice(&ingress.to_ne_bytes());
        ctx[40..44].copy_from_slice(&ingress.to_ne_bytes());
        test_run(tc_full(&mut self.ebpf)?, frame, Some(&ctx))
    }

    /// The underlying aya object (tests and diagnostics).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    fn services(&mut self) -> Result<HashMap<&mut MapData, ServiceKey, ServiceValue>, L4Error> {
        self.hash_map(MAP_SERVICES)
    }

    fn reply_vip_map(&mut self) -> Result<HashMap<&mut MapData, ServiceKey, ServiceKey>, L4Error> {
        self.hash_map(MAP_REPLY_VIP)
    }

    /// Hash map `name` of the loaded object, typed `K → V`.
    fn hash_map<K: aya::Pod, V: aya::Pod>(
        &mut self,
        name: &'static str,
    ) -> Result<HashMap<&mut MapData, K, V>, L4Error> {
        let m = self.ebpf.map_mut(name).ok_or(L4Error::MissingMap(name))?;
        HashMap::try_from(m).map_err(|e| L4Error::map(name, e))
    }

    fn table(
        &mut self,
        name: &'static str,
    ) -> Result<Array<&mut MapData, [u8; WRR_SLOTS as usize]>, L4Error> {
        let m = self.ebpf.map_mut(name).ok_or(L4Error::MissingMap(name))?;
        Array::try_from(m).map_err(|e| L4Error::map(name, e))
    }

    fn endpoints(&mut self) -> Result<Array<&mut MapData, EndpointValue>, L4Error> {
        let m = self
            .ebpf
            .map_mut(MAP_ENDPOINTS)
            .ok_or(L4Error::MissingMap(MAP_ENDPOINTS))?;
        Array::try_from(m).map_err(|e| L4Error::map(MAP_ENDPOINTS, e))
    }
}

impl Drop for Datapath {
    fn drop(&mut self) {
        if let Err(e) = self.detach_all() {
            tracing::warn!(error = %e, "detaching XDP on drop");
        }
    }
}

fn tc(ebpf: &mut Ebpf) -> Result<&mut SchedClassifier, L4Error> {
    let p = ebpf
        .program_mut(TC_PROG_NAME)
        .ok_or(L4Error::MissingProgram(TC_PROG_NAME))?;
    p.try_into().map_err(|e| L4Error::program("type check", e))
}

fn tc_full(ebpf: &mut Ebpf) -> Result<&mut SchedClassifier, L4Error> {
    let p = ebpf
        .program_mut(TC_FULL_PROG_NAME)
        .ok_or(L4Error::MissingProgram(TC_FULL_PROG_NAME))?;
    p.try_into().map_err(|e| L4Error::program("type check", e))
}

/// Removes the entries of `v` matching `pred` and returns them (the rest keep their order).
fn take_where<T>(v: &mut Vec<T>, pred: impl Fn(&T) -> bool) -> Vec<T> {
    let (gone, kept) = std::mem::take(v).into_iter().partition(|x| pred(x));
    *v = kept;
    gone
}

fn xdp(ebpf: &mut Ebpf) -> Result<&mut Xdp, L4Error> {
    let p = ebpf
        .program_mut(PROG_NAME)
        .ok_or(L4Error::MissingProgram(PROG_NAME))?;
    p.try_into().map_err(|e| L4Error::program("type check", e))
}

/// One `BPF_PROG_TEST_RUN` of `prog` on `frame` (with context `ctx`): (return value, output
/// frame).
fn test_run<P>(prog: &P, frame: &[u8], ctx: Option<&[u8]>) -> Result<(u32, Vec<u8>), L4Error>
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = aya::programs::TestRunResult>,
{
    let mut out = vec![0u8; frame.len() + 256];
    let opts = TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        ctx_in: ctx,
        ..Default::default()
    };
    let r = prog
        .test_run(opts)
        .map_err(|e| L4Error::program("test run", e))?;
    out.truncate(r.data_size_out as usize);
    Ok((r.return_value, out))
}

/// A BPF map used as a set of ifindexes (its keys; each key's value is fixed by the map).
trait KeySet {
    /// Adds `key`.
    fn add_key(&mut self, key: u32) -> Result<(), aya::maps::xdp::XdpMapError>;
    /// Removes `key`.
    fn remove_key(&mut self, key: u32) -> Result<(), aya::maps::MapError>;
}

impl KeySet for DevMapHash<&mut MapData> {
    fn add_key(&mut self, key: u32) -> Result<(), aya::maps::xdp::XdpMapError> {
        // The key is the device's own ifindex: the data path redirects by ifindex.
        self.insert(key, key, None, 0)
    }

    fn remove_key(&mut self, key: u32) -> Result<(), aya::maps::MapError> {
        self.remove(key)
    }
}

impl KeySet for HashMap<&mut MapData, u32, u8> {
    fn add_key(&mut self, key: u32) -> Result<(), aya::maps::xdp::XdpMapError> {
        Ok(self.insert(key, 1, 0)?)
    }

    fn remove_key(&mut self, key: u32) -> Result<(), aya::maps::MapError> {
        self.remove(&key)
    }
}

/// What a BPF map used as a key set ([`KeySet`]) holds, as far as loxi knows.
#[derive(Debug, Default)]
struct MapKeys {
    /// Every key the map may hold.
    held: BTreeSet<u32>,
    /// Whether the map holds exactly [`Self::held`] (false after a failed update, when it may
    /// hold any part of it).
    exact: bool,
}

impl MapKeys {
    /// Whether the map is known to hold exactly `want` (nothing to do). An empty map at start
    /// is exact.
    fn is(&self, want: &BTreeSet<u32>) -> bool {
        (self.exact || self.held.is_empty()) && self.held == *want
    }
}

/// Makes the keys of `map` (named `name`) equal `want`. A key already gone counts as removed:
/// the kernel drops a device's entry of a device map when the device is unregistered (a
/// deleted interface would otherwise fail every later update). After a failure, `keys` holds
/// the union of what the map held and `want` (it may now hold any of them), so the next call
/// removes whatever is not wanted by then, and adds every wanted key again (an add that failed
/// is retried; a repeated add overwrites).
fn set_keys(
    map: &mut impl KeySet,
    name: &'static str,
    keys: &mut MapKeys,
    want: &BTreeSet<u32>,
) -> Result<(), L4Error> {
    let mut write = || {
        for &gone in keys.held.difference(want) {
            match map.remove_key(gone) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(L4Error::map(name, e)),
            }
        }
        for &new in want {
            if keys.exact && keys.held.contains(&new) {
                continue;
            }
            map.add_key(new).map_err(|e| L4Error::map(name, e))?;
        }
        Ok(())
    };
    let r = write();
    *keys = match r {
        Ok(()) => MapKeys {
            held: want.clone(),
            exact: true,
        },
        Err(_) => MapKeys {
            held: keys.held.union(want).copied().collect(),
            exact: false,
        },
    };
    r
}

#[cfg(test)]
mod set_keys_tests {
    use std::collections::BTreeSet;

    use aya::maps::MapError;
    use aya::maps::xdp::XdpMapError;

    use super::{KeySet, MapKeys, set_keys};

    /// A key set in memory whose `add_key` of `fail_on` fails.
    struct Fake {
        keys: BTreeSet<u32>,
        fail_on: Option<u32>,
    }

    impl KeySet for Fake {
        fn add_key(&mut self, key: u32) -> Result<(), XdpMapError> {
            if Some(key) == self.fail_on {
                return Err(MapError::OutOfBounds {
                    index: key,
                    max_entries: 0,
                }
                .into());
            }
            self.keys.insert(key);
            Ok(())
        }

        fn remove_key(&mut self, key: u32) -> Result<(), MapError> {
            // A key the map no longer holds (a device unregistered) is KeyNotFound: removed.
            if self.keys.remove(&key) {
                Ok(())
            } else {
                Err(MapError::KeyNotFound)
            }
        }
    }

    fn keys(held: &[u32], exact: bool) -> MapKeys {
        MapKeys {
            held: held.iter().copied().collect(),
            exact,
        }
    }

    #[test]
    fn the_keys_become_the_wanted_set_and_a_failure_leaves_the_union_to_clean_up_next() {
        let mut map = Fake {
            keys: BTreeSet::from([1, 2]),
            fail_on: None,
        };
        let mut had = keys(&[1, 2, 7], true); // 7: already gone from the map
        set_keys(&mut map, "T", &mut had, &BTreeSet::from([2, 3])).expect("set");
        assert_eq!(map.keys, BTreeSet::from([2, 3]));
        assert!(had.is(&BTreeSet::from([2, 3])));

        map.fail_on = Some(5);
        let want = BTreeSet::from([4, 5, 6]);
        let err = set_keys(&mut map, "T", &mut had, &want).expect_err("adding 5 fails");
        assert!(err.to_string().starts_with("map T: "), "{err}");
        assert_eq!(
            map.keys,
            BTreeSet::from([4]),
            "2 and 3 removed, 4 added, then 5 failed"
        );
        assert_eq!(
            had.held,
            BTreeSet::from([2, 3, 4, 5, 6]),
            "what the map may hold"
        );
        assert!(!had.is(&want));

        // The same set again: 5 and 6, never added, are added now.
        map.fail_on = None;
        set_keys(&mut map, "T", &mut had, &want).expect("set");
        assert_eq!(map.keys, want);
        assert!(had.is(&want));
        set_keys(&mut map, "T", &mut had, &BTreeSet::from([6])).expect("set");
        assert_eq!(map.keys, BTreeSet::from([6]));
    }

    #[test]
    fn a_failed_first_add_is_retried_though_the_union_equals_the_wanted_set() {
        let mut map = Fake {
            keys: BTreeSet::new(),
            fail_on: Some(9),
        };
        let mut had = MapKeys::default();
        let want = BTreeSet::from([9]);
        assert!(!had.is(&BTreeSet::from([1])) && had.is(&BTreeSet::new()));
        set_keys(&mut map, "T", &mut had, &want).expect_err("adding 9 fails");
        assert_eq!(had.held, want);
        assert!(
            !had.is(&want),
            "not known to hold it: the next call retries"
        );
        map.fail_on = None;
        set_keys(&mut map, "T", &mut had, &want).expect("set");
        assert_eq!(map.keys, want);
    }
}

#[cfg(test)]
mod retry_tests {
    use aya::programs::ProgramError;

    use super::retry_interrupted;

    /// A `BPF_PROG_LOAD` failure with `errno`.
    fn failed(errno: i32) -> ProgramError {
        ProgramError::LoadError {
            io_error: std::io::Error::from_raw_os_error(errno),
            verifier_log: aya_obj::VerifierLog::new(String::new()),
        }
    }

    /// EAGAIN (the verifier interrupted by a signal) loads again, at most 5 times in all; any
    /// other failure is answered at once.
    #[test]
    fn an_interrupted_load_is_tried_again_up_to_five_times() {
        let mut calls = 0;
        let r = retry_interrupted(|| {
            calls += 1;
            if calls < 3 { Err(failed(11)) } else { Ok(()) }
        });
        assert!(r.is_ok());
        assert_eq!(calls, 3);
        let mut calls = 0;
        let r = retry_interrupted(|| {
            calls += 1;
            Err(failed(11))
        });
        let errno = match r {
            Err(ProgramError::LoadError { io_error, .. }) => io_error.raw_os_error(),
            _ => None,
        };
        assert_eq!(errno, Some(11), "the last EAGAIN is answered");
        assert_eq!(calls, 5);
        let mut calls = 0;
        let r = retry_interrupted(|| {
            calls += 1;
            Err(failed(13))
        });
        assert!(r.is_err());
        assert_eq!(calls, 1, "EACCES (the verifier's refusal) is not retried");
    }
}
