//! Envoy stat ids, defined once per configuration from the names the
//! counters give themselves ([`Counter::stats`]).

use std::collections::HashMap;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::config::Config;
use crate::filter::counter::{tzdb_stat, StatKind, CALLOUT_LATENCY_US};
use crate::filter::{Counter, Histogram};

/// An id Envoy refused to define: updates to it are skipped.
pub const UNDEFINED: u32 = u32::MAX;

#[derive(Default)]
pub struct Metrics {
    /// What each counter event moves: (metric id, increment), at the
    /// event's [`Counter::index`] (a count is an index, not a hash).
    moves: Vec<Vec<(u32, i64)>>,
    /// The configuration's limits, which [`Counter::index`] needs.
    limits: usize,
    /// Gauge: workers of this Envoy whose breaker is open (or probing).
    pub circuit_open_workers: u32,
    pub callout_latency_us: u32,
    histograms: HashMap<Histogram, u32>,
}

fn define(kind: MetricType, name: &str) -> u32 {
    match hostcalls::define_metric(kind, name) {
        Ok(id) => id,
        Err(e) => {
            log::warn!("redis-guard: cannot define metric {name}: {e:?}");
            UNDEFINED
        }
    }
}

impl Metrics {
    pub fn define(config: &Config) -> Metrics {
        let mut ids: HashMap<String, u32> = HashMap::new();
        let mut moves = Vec::new();
        let limit_name = |i: usize| {
            config
                .limits
                .get(i)
                .map_or_else(String::new, |l| l.name.clone())
        };
        for counter in Counter::all(config.limits.len()) {
            let stats = counter.stats(limit_name);
            let ids_moved: Vec<(u32, i64)> = stats
                .into_iter()
                .map(|stat| {
                    let kind = match stat.kind {
                        StatKind::Counter => MetricType::Counter,
                        StatKind::Gauge => MetricType::Gauge,
                    };
                    let id = *ids
                        .entry(stat.name.clone())
                        .or_insert_with(|| define(kind, &stat.name));
                    (id, stat.by)
                })
                .collect();
            // Counter::all's order is Counter::index's.
            moves.push(ids_moved);
        }
        let circuit_open_workers = ids
            .get("redis_guard.circuit.open_workers")
            .copied()
            .unwrap_or(UNDEFINED);
        let histograms = Histogram::ALL
            .iter()
            .map(|h| (*h, define(MetricType::Histogram, h.name())))
            .collect();
        // The tz database release, as an info gauge: defined and set here,
        // once per configuration, so an operator finds it beside the other
        // stats (each worker sets the same 1).
        let tzdb = define(MetricType::Gauge, &tzdb_stat());
        if tzdb != UNDEFINED {
            if let Err(e) = hostcalls::record_metric(tzdb, 1) {
                log::warn!("redis-guard: cannot set {}: {e:?}", tzdb_stat());
            }
        }
        Metrics {
            moves,
            limits: config.limits.len(),
            circuit_open_workers,
            callout_latency_us: define(MetricType::Histogram, CALLOUT_LATENCY_US),
            histograms,
        }
    }

    /// A histogram's id, if Envoy defined it.
    pub fn histogram(&self, h: Histogram) -> Option<u32> {
        self.histograms
            .get(&h)
            .copied()
            .filter(|id| *id != UNDEFINED)
    }

    /// The (metric, increment) pairs a counter event moves.
    pub fn updates(&self, counter: Counter) -> &[(u32, i64)] {
        counter
            .index(self.limits)
            .and_then(|i| self.moves.get(i))
            .map_or(&[], Vec::as_slice)
    }
}
