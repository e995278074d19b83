//! The pools of one listener: every mode-4 rule on the same `externalIP:port`, told apart by
//! `host` and `model_name`, with each rule's endpoints, live loads and selector state.
//!
//! A [`PoolTable`] is immutable and swapped whole on every rule change. Building one has no side
//! effects: an unchanged rule keeps its pool (the same `Arc`, prober and metric handles
//! included); a changed rule gets a new pool whose endpoint loads and health cells carry over
//! for unchanged endpoints and whose selector state is a successor of the old one (the old
//! table keeps serving its in-flight requests with its own). The reconciler then
//! [`Pool::activate`]s the new pools (starts their probers) once the table is in place.

use std::sync::{Arc, OnceLock};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::health::HealthCell;
use crate::health::probe::{self, ProbeSpec};
use crate::routing::admission::{CloseReason, Gate};
use crate::routing::{EndpointLoad, SelectorState};
use crate::rules::model::authority;
use crate::rules::spec::BackendProtocol;
use crate::rules::{RuleKey, StoredRule};

use super::error::ProxyError;
use super::metrics::{PoolMetrics, ProxyMetrics};

/// How `rule`'s endpoints are reached. A `security: 2` rule whose TLS client cannot be built
/// (its CA file vanished since the rule was accepted) gets a client trusting nothing: every
/// connect fails with that reason (logged here) instead of falling back to cleartext.
fn via(rule: &StoredRule) -> super::upstream::Via {
    use super::upstream::Via;
    let Some(tls) = super::upstream_tls::backend_tls(rule) else {
        return if rule.spec.backend == BackendProtocol::Http2 {
            Via::H2
        } else {
            Via::H1
        };
    };
    if tls.insecure {
        tracing::warn!(
            service = rule.id,
            "backend TLS verification is OFF for this rule \
            (backend_tls_insecure: true): any certificate is accepted"
        );
    }
    let timeout = super::ProxyConfig::default().connect_timeout;
    match tls.client(timeout) {
        Ok(c) => Via::Tls(Box::new(c)),
        Err(e) => {
            tracing::error!(service = rule.id, error = %e, "backend TLS configuration failed; \
                the rule's endpoints cannot be reached");
            Via::Unavailable(format!("backend TLS configuration: {e}").into())
        }
    }
}

/// One rule's serving state.
#[derive(Debug)]
pub struct Pool {
    /// The rule (service id + definition).
    pub rule: Arc<StoredRule>,
    /// Upstream authority (`ip:port`, IPv6 bracketed) per `EpIdx`.
    pub authorities: Vec<String>,
    /// Weight per `EpIdx`.
    pub weights: Vec<u32>,
    /// Live load per `EpIdx` (shared across rule updates for unchanged endpoints).
    pub loads: Vec<Arc<EndpointLoad>>,
    /// Selector state (cursor, WRR weights, rings).
    pub state: Arc<SelectorState>,
    /// Health inputs per `EpIdx` (shared across rule updates like `loads`).
    pub health: Vec<Arc<HealthCell>>,
    /// Admission gate per `EpIdx` (`LLB_PD_MAX_INFLIGHT_PER_EP`; shared across rule updates
    /// like `loads`, closed by [`PoolTable::close_dropped_gates`] when its endpoint leaves).
    pub gates: Vec<Arc<Gate>>,
    /// How the endpoints are reached: cleartext HTTP/1.1 or HTTP/2 (`backend_protocol`), or
    /// the rule's own TLS client (`security: 2`).
    pub via: super::upstream::Via,
    /// P/D pins, tier-1 trie and tie cursor, for a rule with `pd_disagg_mode` (a changed rule
    /// starts with no pins and keeps its trie, renumbered, minus removed endpoints).
    pub pd: Option<crate::pd::PdState>,
    /// Stops this pool's active prober when the pool is dropped (set by [`Pool::activate`]).
    prober: OnceLock<CancellationToken>,
    /// Metric handles, resolved on first use.
    metrics: OnceLock<PoolMetrics>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(c) = self.prober.get() {
            c.cancel();
        }
    }
}

impl Pool {
    /// Builds the pool for `rule`, reusing loads and health cells from `old` (same rule key)
    /// where the endpoint authority is unchanged. Touches nothing shared: `old` and its
    /// selector state are left as they are.
    pub fn build(rule: Arc<StoredRule>, old: Option<&Pool>) -> Self {
        let args = &rule.rule.service;
        let eps = &rule.rule.endpoints;
        let authorities: Vec<String> = eps
            .iter()
            .map(|e| authority(&e.endpoint_ip, crate::routing::state::target_port(args, e)))
            .collect();
        let loads = carry_over(&authorities, old, |o| &o.loads, EndpointLoad::new);
        let health: Vec<Arc<HealthCell>> =
            carry_over(&authorities, old, |o| &o.health, Arc::default);
        let gates = carry_over(&authorities, old, |o| &o.gates, Arc::default);
        let state = match old {
            Some(o) if o.rule.rule == rule.rule => o.state.clone(),
            Some(o) => o.state.successor(args, eps),
            None => SelectorState::new(args, eps),
        };
        Self {
            weights: eps.iter().map(|e| e.weight).collect(),
            via: via(&rule),
            pd: rule.spec.pd.as_ref().map(|spec| {
                // Tier 1's trie follows each endpoint by authority; a removed one is forgotten.
                crate::pd::PdState::successor(spec, old.and_then(|o| o.pd.as_ref()), |ep| {
                    let a = old.and_then(|o| o.authorities.get(ep))?;
                    authorities.iter().position(|x| x == a)
                })
            }),
            authorities,
            loads,
            health,
            gates,
            state,
            rule,
            prober: OnceLock::new(),
            metrics: OnceLock::new(),
        }
    }

    /// Starts the pool's side effects, once: the rule's active prober (spawned into `tasks`,
    /// stopped when the pool drops or `stop` is cancelled), or, for a rule without a probe,
    /// clearing probe state so a rule that dropped its probe does not keep endpoints down.
    pub fn activate(&self, tasks: &TaskTracker, stop: &CancellationToken) {
        if self.prober.get().is_some() {
            return;
        }
        let Some(spec) = ProbeSpec::from_args(&self.rule.rule.service) else {
            for (cell, load) in self.health.iter().zip(&self.loads) {
                cell.probe_down
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                cell.publish(load);
            }
            return;
        };
        let targets = self
            .authorities
            .iter()
            .zip(self.health.iter().zip(&self.loads))
            .map(|(a, (c, l))| probe::Target {
                authority: a.clone(),
                cell: c.clone(),
                load: l.clone(),
            })
            .collect();
        let cancel = stop.child_token();
        if self.prober.set(cancel.clone()).is_ok() {
            tasks.spawn(probe::run(spec, targets, cancel));
        }
    }

    /// This pool's metric handles if [`Self::metrics`] has resolved them (every request's
    /// [`super::body::Tracked`] guard has, when it is made).
    pub fn resolved_metrics(&self) -> Option<&PoolMetrics> {
        self.metrics.get()
    }

    /// This pool's metric handles (resolved from `m` on first use).
    pub fn metrics(&self, m: &ProxyMetrics) -> &PoolMetrics {
        self.metrics.get_or_init(|| {
            if self.pd.is_some() {
                m.pd.init_service(self.rule.id);
            }
            let sel = self.rule.spec.sel.name();
            PoolMetrics::new(
                m,
                self.rule.id,
                sel,
                &self.rule.rule.service.model_name,
                self.authorities.len(),
            )
        })
    }

    /// Does routing need the parsed body? (Tier 1.5 or a prefix-keyed selector.)
    pub fn needs_body(&self) -> bool {
        self.rule.spec.needs_body()
    }

    /// The rule key.
    pub fn key(&self) -> RuleKey {
        self.rule.rule.key()
    }
}

/// All pools of one listener.
#[derive(Debug, Default)]
pub struct PoolTable {
    /// Pools ordered by rule key.
    pub pools: Vec<Arc<Pool>>,
}

impl PoolTable {
    /// True when the listener terminates TLS: its rules have `security` 1 (the API refuses
    /// plain and TLS rules on one address).
    pub fn tls(&self) -> bool {
        self.pools.iter().any(|p| p.rule.rule.service.security != 0)
    }

    /// A new table for `rules`: the pool of an unchanged rule (same id and definition) is
    /// reused as is; others are built, carrying state over from `old`. No side effects (see
    /// [`PoolTable::activate`]).
    pub fn build(rules: &[Arc<StoredRule>], old: &PoolTable) -> Self {
        let pools = rules
            .iter()
            .map(|r| {
                let key = r.rule.key();
                match old.pools.iter().find(|p| p.key() == key) {
                    Some(p) if *p.rule == **r => p.clone(),
                    prev => Arc::new(Pool::build(r.clone(), prev.map(|p| p.as_ref()))),
                }
            })
            .collect();
        Self { pools }
    }

    /// Removes the metric series that `next` (the table replacing this one) no longer backs:
    /// every series of a service that is gone, and those of each position whose endpoint was
    /// removed or replaced (another authority now sits there). Called before `next` serves,
    /// so no request of `next` can resolve a series that is then removed.
    pub fn forget_replaced(&self, next: &PoolTable, m: &ProxyMetrics) {
        for old in &self.pools {
            let id = old.rule.id;
            match next.pools.iter().find(|p| p.rule.id == id) {
                None => m.forget_service(id, old.authorities.len()),
                Some(new) if Arc::ptr_eq(new, old) => {}
                Some(new) => {
                    for (ep, authority) in old.authorities.iter().enumerate() {
                        if new.authorities.get(ep) != Some(authority) {
                            m.forget_endpoint(id, ep);
                        }
                    }
                    if new.pd.is_none() && old.pd.is_some() {
                        m.pd.forget_service(id);
                    }
                }
            }
        }
    }

    /// Closes the admission gates of this table that `next` (the table replacing it; empty when
    /// the listener closes) no longer holds: the endpoint left its rule or the rule was
    /// deleted. Their parked requests are answered at once (503 `pd_admission_closed`) rather
    /// than waiting on an endpoint nothing routes to any more; admitted ones finish.
    pub fn close_dropped_gates(&self, next: &PoolTable, why: CloseReason) {
        for gate in self.pools.iter().flat_map(|p| &p.gates) {
            let kept = next
                .pools
                .iter()
                .flat_map(|p| &p.gates)
                .any(|g| Arc::ptr_eq(g, gate));
            if !kept {
                gate.close(why);
            }
        }
    }

    /// Activates every pool not yet active (see [`Pool::activate`]).
    pub fn activate(&self, tasks: &TaskTracker, stop: &CancellationToken) {
        for p in &self.pools {
            p.activate(tasks, stop);
        }
    }

    /// The client-connection idle timeout the listener's rules ask for: the largest non-zero
    /// `inactiveTimeOut` (seconds) among them, so no rule's clients are cut sooner than its
    /// rule says; `None` when none sets one (then `LOXI_IDLE_TIMEOUT_MS` applies).
    pub fn idle_timeout(&self) -> Option<std::time::Duration> {
        self.pools
            .iter()
            .map(|p| p.rule.rule.service.inactive_timeout)
            .filter(|s| *s != 0)
            .max()
            .map(|s| std::time::Duration::from_secs(u64::from(s)))
    }

    /// True when the pool choice depends on the request's model (several pools, or a named
    /// model pool).
    pub fn routes_by_model(&self) -> bool {
        self.pools.len() > 1
            || self
                .pools
                .iter()
                .any(|p| !p.rule.rule.service.model_name.is_empty())
    }

    /// The pools serving a request's host: pools whose `host` names it ([`same_host`]:
    /// case-insensitive, one trailing dot ignored; port ignored), else host-less pools, in
    /// rule-key order; `no_route` when there are none. Every model pool among them (one per
    /// `model_name`) is included.
    pub fn for_host(&self, host: Option<&str>) -> Result<Vec<&Arc<Pool>>, ProxyError> {
        let host = host.map(strip_port).unwrap_or("");
        let cands: Vec<&Arc<Pool>> = self.serving(host).collect();
        if cands.is_empty() {
            return Err(ProxyError::NoRoute {
                host: host.to_string(),
            });
        }
        Ok(cands)
    }

    /// The pools serving `host` (port already stripped), as [`Self::for_host`] lists them,
    /// without collecting them (every request chooses a pool).
    fn serving<'a, 'h>(
        &'a self,
        host: &'h str,
    ) -> impl Iterator<Item = &'a Arc<Pool>> + Clone + use<'a, 'h> {
        let names = move |p: &Arc<Pool>| same_host(&p.rule.rule.service.host, host);
        let by_host = self.pools.iter().any(names);
        self.pools.iter().filter(move |p| {
            if by_host {
                names(p)
            } else {
                p.rule.rule.service.host.is_empty()
            }
        })
    }

    /// True when some pool's rule `host` names `name` ([`same_host`]): the SNI names a TLS
    /// handshake gets a rule host's certificate for.
    pub fn has_host(&self, name: &str) -> bool {
        self.pools
            .iter()
            .any(|p| same_host(&p.rule.rule.service.host, name))
    }

    /// The pool for a request: among the pools for its host ([`Self::for_host`]) the pool whose
    /// `model_name` equals the model (case-sensitive), else the wildcard (`""`) pool, else
    /// `model_unavailable`; `no_route` when no pool serves the host.
    pub fn choose(
        &self,
        host: Option<&str>,
        model: Option<&str>,
    ) -> Result<&Arc<Pool>, ProxyError> {
        let host = host.map(strip_port).unwrap_or("");
        let model = model.unwrap_or("");
        let mut cands = self.serving(host).peekable();
        if cands.peek().is_none() {
            return Err(ProxyError::NoRoute {
                host: host.to_string(),
            });
        }
        cands
            .clone()
            .find(|p| !model.is_empty() && p.rule.rule.service.model_name == model)
            .or_else(|| cands.find(|p| p.rule.rule.service.model_name.is_empty()))
            .ok_or_else(|| ProxyError::ModelUnavailable {
                model: model.to_string(),
            })
    }
}

/// True when the non-empty rule host `rule_host` and the requested `name` (a `Host` without
/// its port, or an SNI name) are the same host: compared case-insensitively, each with one
/// trailing dot removed (`api.example.com.` is the fully qualified spelling of
/// `api.example.com`, RFC 1034 §3.1). An empty rule host names nothing. IPv6 addresses (the
/// rule's stored canonical, `rules::validate::host_key`) compare as addresses, so any spelling
/// of one in a request (`[fd00:0::1]:8080`, bracket-stripped) is that host.
pub fn same_host(rule_host: &str, name: &str) -> bool {
    !rule_host.is_empty()
        && (dotless(rule_host).eq_ignore_ascii_case(dotless(name))
            || (rule_host.contains(':')
                && name.contains(':')
                && matches!(
                    (rule_host.parse::<std::net::Ipv6Addr>(), name.parse::<std::net::Ipv6Addr>()),
                    (Ok(a), Ok(b)) if a == b
                )))
}

/// `h` without one trailing dot.
fn dotless(h: &str) -> &str {
    h.strip_suffix('.').unwrap_or(h)
}

fn strip_port(h: &str) -> &str {
    if let Some(rest) = h.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    h.rsplit_once(':')
        .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
        .map_or(h, |(a, _)| a)
}

/// The cell `old` kept for endpoint authority `a`, if the endpoint existed before.
fn carried<T>(
    a: &str,
    old: Option<&Pool>,
    cells: impl Fn(&Pool) -> &Vec<Arc<T>>,
) -> Option<Arc<T>> {
    let o = old?;
    o.authorities
        .iter()
        .position(|x| x == a)
        .map(|i| cells(o)[i].clone())
}

/// Per-endpoint cells for `authorities`: carried over from `old` for unchanged endpoints, else
/// `fresh()`.
fn carry_over<T>(
    authorities: &[String],
    old: Option<&Pool>,
    cells: impl Fn(&Pool) -> &Vec<Arc<T>>,
    fresh: impl Fn() -> Arc<T>,
) -> Vec<Arc<T>> {
    authorities
        .iter()
        .map(|a| carried(a, old, &cells).unwrap_or_else(&fresh))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(id: u32, host: &str, model: &str, eps: &[u16]) -> Arc<StoredRule> {
        let eps: Vec<_> = eps
            .iter()
            .map(|p| serde_json::json!({"endpointIP": "127.0.0.1", "targetPort": p}))
            .collect();
        let rule = serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": 8080, "mode": 4, "host": host, "model_name": model},
            "endpoints": eps,
        }))
        .expect("rule");
        Arc::new(StoredRule::new(id, rule).expect("valid rule"))
    }

    #[test]
    fn model_pools_exact_then_wildcard_then_unavailable() {
        let t = PoolTable::build(
            &[rule(1, "", "llama", &[1]), rule(2, "", "", &[2])],
            &PoolTable::default(),
        );
        assert_eq!(t.choose(None, Some("llama")).expect("pool").rule.id, 1);
        assert_eq!(t.choose(None, Some("Llama")).expect("pool").rule.id, 2);
        assert_eq!(t.choose(None, None).expect("pool").rule.id, 2);
        let t = PoolTable::build(&[rule(1, "", "llama", &[1])], &PoolTable::default());
        let e = t.choose(Some("x:80"), Some("qwen")).expect_err("no pool");
        assert_eq!(e.token(), "model_not_found");
    }

    #[test]
    fn host_pools_win_over_hostless() {
        let t = PoolTable::build(
            &[rule(1, "a.example", "", &[1]), rule(2, "", "", &[2])],
            &PoolTable::default(),
        );
        assert_eq!(
            t.choose(Some("A.example:8080"), None)
                .expect("pool")
                .rule
                .id,
            1
        );
        assert_eq!(t.choose(Some("b.example"), None).expect("pool").rule.id, 2);
        let t = PoolTable::build(&[rule(1, "a.example", "", &[1])], &PoolTable::default());
        assert_eq!(
            t.choose(Some("b.example"), None).expect_err("none").token(),
            "no_route"
        );
    }

    /// An IPv6 rule host (stored canonical, without brackets) serves a request naming it in
    /// brackets with or without a port, in any case or spelling.
    #[test]
    fn an_ipv6_host_matches_its_bracketed_spellings() {
        let t = PoolTable::build(
            &[rule(1, "fd00::1", "", &[1]), rule(2, "", "", &[2])],
            &PoolTable::default(),
        );
        for host in ["[fd00::1]:8080", "[FD00::1]", "[fd00:0:0::1]:80"] {
            assert_eq!(
                t.choose(Some(host), None).expect("pool").rule.id,
                1,
                "{host}"
            );
        }
        assert_eq!(
            t.choose(Some("[fd00::2]:80"), None).expect("pool").rule.id,
            2
        );
    }

    #[test]
    fn a_trailing_dot_names_the_same_host() {
        let t = PoolTable::build(
            &[rule(1, "api.example.com", "", &[1]), rule(2, "", "", &[2])],
            &PoolTable::default(),
        );
        for host in [
            "api.example.com.",
            "API.example.com.:8080",
            "api.example.com:8080",
        ] {
            assert_eq!(
                t.choose(Some(host), None).expect("pool").rule.id,
                1,
                "{host}"
            );
            assert_eq!(t.for_host(Some(host)).expect("pools").len(), 1, "{host}");
        }
        assert_eq!(
            t.choose(Some("api.example.com.."), None)
                .expect("pool")
                .rule
                .id,
            2,
            "one dot only"
        );
        assert!(t.has_host("api.example.com.") && t.has_host("API.EXAMPLE.COM"));
        assert!(!t.has_host("example.com") && !t.has_host(""));
        assert!(same_host("api.example.com.", "api.example.com"));
        assert!(!same_host("", "") && !same_host("", "."));
    }

    #[test]
    fn loads_survive_updates_for_unchanged_endpoints() {
        let t1 = PoolTable::build(&[rule(1, "", "", &[1, 2])], &PoolTable::default());
        let _g = t1.pools[0].loads[1].begin();
        let t2 = PoolTable::build(&[rule(1, "", "", &[2, 3])], &t1);
        assert_eq!(
            t2.pools[0].loads[0].in_flight(),
            1,
            "endpoint :2 kept its load"
        );
        assert_eq!(t2.pools[0].loads[1].in_flight(), 0);
        assert_eq!(t2.pools[0].state.topology.load().ids.len(), 2);
    }

    #[test]
    fn gates_carry_over_and_the_dropped_ones_close() {
        use crate::routing::admission::{Entry, Refusal};
        let t1 = PoolTable::build(&[rule(1, "", "", &[1, 2])], &PoolTable::default());
        let _held = t1.pools[0].gates[1].enter(1, 1).expect("admitted");
        let t2 = PoolTable::build(&[rule(1, "", "", &[2, 3])], &t1);
        assert!(Arc::ptr_eq(&t1.pools[0].gates[1], &t2.pools[0].gates[0]));
        assert_eq!(
            t2.pools[0].gates[0].admitted(),
            1,
            "endpoint :2 kept its slot"
        );
        t1.close_dropped_gates(&t2, CloseReason::Removed);
        let removed = &t1.pools[0].gates[0];
        assert_eq!(
            removed.enter(1, 1).err(),
            Some(Refusal::Closed(CloseReason::Removed)),
            "endpoint :1 left the rule"
        );
        assert!(matches!(
            t2.pools[0].gates[0].enter(1, 1),
            Ok(Entry::Parked(_))
        ));
        t2.close_dropped_gates(&PoolTable::default(), CloseReason::Shutdown);
        assert_eq!(
            t2.pools[0].gates[1].enter(1, 1).err(),
            Some(Refusal::Closed(CloseReason::Shutdown))
        );
    }

    /// A tier-1 P/D rule over `(targetPort, ep_role)` endpoints.
    fn pd_rule(eps: &[(u16, u8)]) -> Arc<StoredRule> {
        let eps: Vec<_> = eps
            .iter()
            .map(|(p, r)| serde_json::json!({"endpointIP": "127.0.0.1", "targetPort": p, "ep_role": r}))
            .collect();
        let rule = serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": 8080, "mode": 4,
                "pd_disagg_mode": true, "pd_cache_aware_mode": true},
            "endpoints": eps,
        }))
        .expect("rule");
        Arc::new(StoredRule::new(1, rule).expect("valid rule"))
    }

    #[test]
    fn the_tier_1_trie_follows_endpoints_and_forgets_a_removed_one() {
        let key = [crate::pd::trie::TEXT_TAG, 'a' as u32, 'b' as u32];
        let t1 = PoolTable::build(&[pd_rule(&[(1, 1), (2, 1), (3, 2)])], &PoolTable::default());
        {
            let trie = t1.pools[0]
                .pd
                .as_ref()
                .and_then(|s| s.trie.as_ref())
                .expect("trie");
            trie.lock().insert(&key, 0);
            trie.lock().insert(&key, 1);
        }
        // Endpoint :1 removed; :2 moves from index 1 to 0.
        let t2 = PoolTable::build(&[pd_rule(&[(2, 1), (3, 2), (4, 1)])], &t1);
        let trie = t2.pools[0]
            .pd
            .as_ref()
            .and_then(|s| s.trie.as_ref())
            .expect("trie");
        let m = trie.lock().longest_match(&key, |_| true).expect("carried");
        assert_eq!((m.matched, m.holders), (3, vec![0]));
    }

    /// The `service="{id}"` series lines of the proxy's families in a scrape.
    fn series(reg: &prometheus_client::registry::Registry, id: u32) -> Vec<String> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, reg).expect("encode");
        let needle = format!("service=\"{id}\"");
        text.lines()
            .filter(|l| l.starts_with("loxilb_proxy_") && l.contains(&needle))
            .filter(|l| !l.contains("_bucket{"))
            .map(|l| l.rsplit_once(' ').map_or(l, |(k, _)| k).to_string())
            .collect()
    }

    /// Issue 12 §1: replacing or removing an endpoint removes its position's series (no
    /// series is continued by the endpoint that takes the position), and deleting the rule
    /// removes every series of its service.
    #[test]
    fn replaced_and_deleted_endpoints_leave_no_series() {
        let mut reg = prometheus_client::registry::Registry::default();
        let m = ProxyMetrics::register(&mut reg);
        let t1 = PoolTable::build(&[rule(7, "", "", &[1, 2, 3])], &PoolTable::default());
        let pm = t1.pools[0].metrics(&m);
        for ep in 0..3 {
            pm.request(ep, http::StatusCode::OK);
        }
        pm.request(2, http::StatusCode::BAD_GATEWAY);
        m.request(7, None, http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            series(&reg, 7).contains(
                &"loxilb_proxy_requests_total{service=\"7\",ep_idx=\"2\",class=\"5xx\"}"
                    .to_string()
            ),
            "{:?}",
            series(&reg, 7)
        );
        // :1 stays at 0, :3 is replaced by :4 at position 2, :2 stays at 1.
        let t2 = PoolTable::build(&[rule(7, "", "", &[1, 2, 4])], &t1);
        t1.forget_replaced(&t2, &m);
        let after = series(&reg, 7);
        assert!(
            after.iter().all(|l| !l.contains("ep_idx=\"2\"")),
            "replaced position kept a series: {after:?}"
        );
        assert!(
            after.contains(
                &"loxilb_proxy_requests_total{service=\"7\",ep_idx=\"1\",class=\"2xx\"}"
                    .to_string()
            ),
            "unchanged endpoint keeps its series: {after:?}"
        );
        // The new endpoint at position 2 starts from zero.
        t2.pools[0].metrics(&m).request(2, http::StatusCode::OK);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).expect("encode");
        assert!(
            text.contains(
                "loxilb_proxy_requests_total{service=\"7\",ep_idx=\"2\",class=\"2xx\"} 1\n"
            ),
            "{text}"
        );
        // Removing the last endpoint drops position 2 again; deleting the rule drops all.
        let t3 = PoolTable::build(&[rule(7, "", "", &[1, 2])], &t2);
        t2.forget_replaced(&t3, &m);
        assert!(series(&reg, 7).iter().all(|l| !l.contains("ep_idx=\"2\"")));
        t3.forget_replaced(&PoolTable::default(), &m);
        assert_eq!(series(&reg, 7), Vec::<String>::new());
    }

    #[test]
    fn unchanged_pools_are_reused_and_building_leaves_the_old_table_alone() {
        let t1 = PoolTable::build(
            &[rule(1, "", "a", &[1, 2]), rule(2, "", "", &[3])],
            &PoolTable::default(),
        );
        let old_topology = t1.pools[0].state.topology.load_full();
        let t2 = PoolTable::build(&[rule(1, "", "a", &[1, 4]), rule(2, "", "", &[3])], &t1);
        assert!(
            Arc::ptr_eq(&t1.pools[1], &t2.pools[1]),
            "rule 2 unchanged: same pool"
        );
        assert!(!Arc::ptr_eq(&t1.pools[0], &t2.pools[0]));
        assert!(
            Arc::ptr_eq(&t1.pools[0].state.topology.load_full(), &old_topology),
            "the old pool keeps its own topology for its in-flight requests"
        );
        assert_ne!(
            t1.pools[0].state.topology.load().ids,
            t2.pools[0].state.topology.load().ids
        );
        assert!(Arc::ptr_eq(&t1.pools[0].loads[0], &t2.pools[0].loads[0]));
    }
}
