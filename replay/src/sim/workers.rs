//! The simulated workers: each one's LRU prefix cache and the kv-events it publishes into the
//! real index, its load samples into the real store, its prefill lane, and its events (prefill
//! done, request finished) in time order; and a request's pick, placement and service on them.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};
use std::time::Duration;

use continuum_actors::picker::answer_arrivals;
use continuum_protocol::event_plane::ActiveLoad;
use continuum_protocol::ids::{DpRank, InstanceId, PublisherId, WorkerKey};
use continuum_protocol::kv::events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, ResidencyDomain,
    RouterEvent, StorageTier, StoredBlock,
};
use continuum_protocol::kv::hashing::sequence_hashes;
use continuum_protocol::kv::mooncake::{BlockLru, splitmix64};
use continuum_protocol::kv::{ExternalBlockHash, KvEventResult, KvIndex, LocalBlockHash};
use continuum_protocol::load_store::{LoadSample, LoadStore};
use continuum_protocol::picker::candidates::StoreView;
use continuum_protocol::picker::{
    BlockOverlaps, Candidate, CandidateRole, DispatchId, DispatchLeg, DynamoWorkerPicker,
    KvPickInput, KvPickOutcome, LoadBasedPicker, PickContext, PickRequest, PickerState,
};
use continuum_protocol::time::{Tick, UnixMillis};

use super::replicas::{Delayed, SharedDispatch, micros};
use super::{MODEL, Picking, Placement, Policy, PolicyRun, SimConfig};
use crate::trace::TraceRequest;

#[derive(Debug)]
pub(super) struct SimWorker {
    id: InstanceId,
    key: WorkerKey,
    /// Tokens per block of its card.
    block_size: u64,
    /// A decode or aggregated worker (not a prefill worker).
    pub(super) decodes: bool,
    lru: BlockLru,
    event_id: u64,
    lane_free_us: u64,
    prefill_tokens: u64,
    pub(super) active_blocks: u64,
    /// Index of the last load tick published.
    published_tick: Option<u64>,
    sequence: u64,
}

#[derive(Debug)]
enum WorkerEvent {
    PrefillDone {
        worker: usize,
        tokens: u64,
        /// Blocks a prefill worker held for the request until its KV left.
        blocks: u64,
    },
    Finished {
        worker: usize,
        blocks: u64,
        /// The replica that dispatched it and its ledger's id.
        dispatch: Option<(usize, DispatchId)>,
    },
}

pub(super) struct Sim<'a> {
    cfg: &'a SimConfig,
    pub(super) workers: Vec<SimWorker>,
    store: LoadStore,
    index: KvIndex,
    /// One picker state (dispatch ledger, cursors) per router replica.
    states: Vec<PickerState>,
    /// Load samples on their way to the replicas (`load_lag` > 0 only).
    delayed_load: Delayed<LoadSample>,
    /// Dispatches on their way to the dispatching replica's peers (sharing only).
    delayed_share: Delayed<SharedDispatch>,
    lag_us: u64,
    /// (time µs, order) → index into `events`.
    due: BinaryHeap<Reverse<(u64, u64)>>,
    events: Vec<Option<WorkerEvent>>,
    interval_us: u64,
    draws: u64,
}

impl<'a> Sim<'a> {
    /// The fleet of `candidates`, idle, every worker live in the store and the index.
    pub(super) fn new(cfg: &'a SimConfig, candidates: &[Candidate]) -> Self {
        let mut sim = Sim {
            cfg,
            workers: candidates
                .iter()
                .map(|c| SimWorker {
                    id: c.worker.instance_id,
                    key: c.worker.clone(),
                    block_size: u64::from(c.block_size.unwrap_or(cfg.block_size.get()).max(1)),
                    decodes: c.role != CandidateRole::Prefill,
                    lru: BlockLru::new(usize::try_from(cfg.capacity_blocks).unwrap_or(usize::MAX)),
                    event_id: 0,
                    lane_free_us: 0,
                    prefill_tokens: 0,
                    active_blocks: 0,
                    published_tick: None,
                    sequence: 0,
                })
                .collect(),
            store: LoadStore::new(),
            index: KvIndex::new(splitmix64(cfg.seed)),
            states: (0..cfg.replicas.count.max(1))
                .map(|replica| {
                    let mut state = PickerState::new();
                    state.tie.set(cfg.replicas.tie_break(cfg.seed, replica));
                    state.ledger.set_place(cfg.replicas.place(replica));
                    state
                })
                .collect(),
            delayed_load: Delayed::default(),
            delayed_share: Delayed::default(),
            lag_us: micros(cfg.replicas.load_lag),
            due: BinaryHeap::new(),
            events: Vec::new(),
            interval_us: u64::try_from(cfg.load_interval.as_micros())
                .unwrap_or(u64::MAX)
                .max(1),
            draws: 0,
        };
        sim.store
            .set_live_and_retain(sim.workers.iter().map(|w| w.id));
        sim.index.set_live_and_retain(
            sim.workers
                .iter()
                .map(|w| (w.id, BTreeSet::from([DpRank(0)])))
                .collect(),
        );
        sim
    }

    /// Step 2: `replica`'s picker decides as `ShimRouter::decide` does. Returns the outcome and
    /// the overlaps the kv policy read from the index (none for the other policies).
    pub(super) fn pick(
        &mut self,
        picking: &Picking<'_>,
        replica: usize,
        request: &TraceRequest,
        now: Tick,
    ) -> (KvPickOutcome, Vec<BlockOverlaps>) {
        let isl = request.input_tokens;
        let ledger = &mut self.states[replica].ledger;
        answer_arrivals(ledger, &self.store);
        ledger.expire(now);
        let pick_request = PickRequest {
            model: MODEL,
            eligible_namespaces: &picking.namespaces,
            estimated_prompt_tokens: isl,
            load_signals: picking.policy != Policy::RoundRobin,
        };
        let mut overlaps = Vec::new();
        let unit = self.draw_unit();
        if picking.policy == Policy::Kv {
            overlaps.push(BlockOverlaps {
                block_size: self.cfg.block_size,
                ranks: self.index.find_matches(&request.blocks),
            });
        }
        let outcome = {
            let view = StoreView {
                store: &self.store,
                now,
                max_age: self.cfg.max_staleness,
            };
            let mut ctx = PickContext::new(
                &pick_request,
                picking.candidates,
                &view,
                &mut self.states[replica],
                now,
            )
            .with_layout(&picking.layout);
            match picking.policy {
                Policy::Kv => {
                    let input = KvPickInput {
                        isl,
                        overlaps: &overlaps,
                        unit,
                    };
                    picking.kv_picker.pick_kv(&mut ctx, Ok(&input))
                }
                Policy::Load | Policy::RoundRobin => KvPickOutcome {
                    outcome: LoadBasedPicker.pick(&mut ctx),
                    kv: None,
                },
            }
        };
        (outcome, overlaps)
    }

    /// Steps 3 and 4 for a placed request: the caches serve and learn the prompt, the latency
    /// model times it, the workers' load changes until its events, and `run` counts it. Returns
    /// the blocks the prefilling worker's cache held.
    pub(super) fn serve(
        &mut self,
        request: &TraceRequest,
        arrival: u64,
        placement: &Placement,
        overlaps: &[BlockOverlaps],
        policy: Policy,
        run: &mut PolicyRun,
    ) -> usize {
        let cfg = self.cfg;
        let bs = u64::from(cfg.block_size.get());
        let isl = request.input_tokens;
        let (decode, prefill) = (placement.decode, placement.prefill);
        // The prefilling worker: the pair's prefill worker, else the decode worker itself.
        let prefiller = prefill.unwrap_or(decode);
        let hit = self.serve_blocks(prefiller, &request.blocks, run);
        if policy == Policy::Kv {
            let predicted = overlaps
                .first()
                .map_or(0, |o| o.of(self.workers[prefiller].id, DpRank(0)));
            if predicted != hit as u64 {
                run.index_disagreements += 1;
            }
        }
        let cached_tokens = (hit as u64 * bs).min(isl);
        let uncached = isl - cached_tokens;
        let start = arrival.max(self.workers[prefiller].lane_free_us);
        let prefill_us = cfg.latency.prefill_us(uncached);
        run.prefill_busy_us += prefill_us;
        let prefill_done = start.saturating_add(prefill_us);
        let blocks = (isl + request.output_tokens).div_ceil(bs);
        let prompt_blocks = isl.div_ceil(bs);
        // A pair: the decode worker's own prefix cache serves what it holds, the rest of the
        // prompt's KV is transferred, and decoding starts when it has arrived.
        let first_token = match prefill {
            Some(_) => {
                let held = self.serve_blocks(decode, &request.blocks, run);
                let transferred = isl - (held as u64 * bs).min(isl);
                run.transferred_tokens += transferred;
                prefill_done.saturating_add(cfg.latency.transfer_us(transferred))
            }
            None => prefill_done,
        };
        let finish = first_token.saturating_add(cfg.latency.decode_us(request.output_tokens));
        let held_by_prefiller = if prefill.is_some() { prompt_blocks } else { 0 };
        {
            let w = &mut self.workers[prefiller];
            w.lane_free_us = prefill_done;
            w.prefill_tokens += uncached;
            w.active_blocks += held_by_prefiller;
        }
        self.workers[decode].active_blocks += blocks;
        self.schedule(
            prefill_done,
            WorkerEvent::PrefillDone {
                worker: prefiller,
                tokens: uncached,
                blocks: held_by_prefiller,
            },
        );
        self.schedule(
            finish,
            WorkerEvent::Finished {
                worker: decode,
                blocks,
                dispatch: placement.dispatch.map(|id| (placement.replica, id)),
            },
        );
        if self.states.len() > 1 && cfg.replicas.sharing && placement.dispatch.is_some() {
            self.share(placement, isl, arrival);
        }

        run.requests += 1;
        run.requests_per_worker[decode] += 1;
        if let Some(p) = prefill {
            run.requests_per_worker[p] += 1;
        }
        run.input_tokens += isl;
        run.cached_tokens += cached_tokens;
        run.prompt_blocks += request.blocks.len() as u64;
        run.hit_blocks += hit as u64;
        run.ttft_us.push(first_token - arrival);
        run.e2e_us.push(finish - arrival);
        hit
    }

    /// Queues a placed request's ledger legs (as the picker recorded them) for the dispatching
    /// replica's peers, `share_lag` after `now_us`; a peer's copy never marks a stall.
    fn share(&mut self, placement: &Placement, tokens: u64, now_us: u64) {
        let leg = |w: &SimWorker, prefill_tokens, decode_blocks| DispatchLeg {
            worker: w.key.clone(),
            rank: DpRank(0),
            prefill_tokens,
            decode_blocks,
            request_blocks: decode_blocks.max(prefill_tokens.div_ceil(w.block_size)),
            stall_exempt: true,
        };
        let decode = &self.workers[placement.decode];
        let mut legs = Vec::with_capacity(2);
        if let Some(p) = placement.prefill {
            legs.push(leg(&self.workers[p], tokens, 0));
        }
        legs.push(leg(decode, 0, tokens.div_ceil(decode.block_size)));
        let deliver_us = now_us.saturating_add(micros(self.cfg.replicas.share_lag));
        self.delayed_share.push(
            deliver_us,
            SharedDispatch {
                deliver_us,
                origin: placement.replica,
                legs,
            },
        );
    }

    /// Publishes `worker`'s load as of the last tick at or before `t_us` (the state before any
    /// change at `t_us`), if that tick was not published yet.
    fn flush(&mut self, worker: usize, t_us: u64) {
        let tick = t_us / self.interval_us;
        let w = &mut self.workers[worker];
        if w.published_tick.is_some_and(|p| p >= tick) {
            return;
        }
        w.published_tick = Some(tick);
        w.sequence += 1;
        let at_us = tick * self.interval_us;
        let sample = LoadSample {
            load: ActiveLoad {
                worker_id: w.id,
                dp_rank: DpRank(0),
                active_decode_blocks: Some(w.active_blocks),
                active_prefill_tokens: Some(w.prefill_tokens),
                kv_used_blocks: Some(w.active_blocks),
            },
            publisher_id: PublisherId(w.id.0),
            sequence: w.sequence,
            published_at: UnixMillis(at_us / 1000),
            received_at: Tick(Duration::from_micros(at_us)),
        };
        if self.lag_us == 0 {
            self.store.apply(sample);
        } else {
            let due = at_us.saturating_add(self.lag_us);
            let received_at = Tick(Duration::from_micros(due));
            self.delayed_load.push(
                due,
                LoadSample {
                    received_at,
                    ..sample
                },
            );
        }
    }

    fn schedule(&mut self, at_us: u64, event: WorkerEvent) {
        let order = self.events.len() as u64;
        self.events.push(Some(event));
        self.due.push(Reverse((at_us, order)));
    }

    /// Applies worker events due at or before `t_us` and publishes the load ticks they and `t_us`
    /// close; with a load lag, the ticks up to `t_us - lag` first (the ones delivered by now),
    /// then the samples and peers' dispatches due by `t_us` reach the replicas.
    pub(super) fn advance(&mut self, t_us: u64) {
        if self.lag_us > 0 && t_us >= self.lag_us {
            self.apply_due(t_us - self.lag_us);
        }
        self.apply_due(t_us);
        while let Some(sample) = self.delayed_load.pop_due(t_us) {
            self.store.apply(sample);
        }
        while let Some(shared) = self.delayed_share.pop_due(t_us) {
            let at = Tick(Duration::from_micros(shared.deliver_us));
            for (r, state) in self.states.iter_mut().enumerate() {
                if r != shared.origin {
                    state.ledger.record_dispatch(&shared.legs, at);
                }
            }
        }
    }

    /// Applies worker events due at or before `t_us`, in time order, then publishes every
    /// worker's tick at `t_us`.
    fn apply_due(&mut self, t_us: u64) {
        while let Some(Reverse((at, order))) = self.due.peek().copied() {
            if at > t_us {
                break;
            }
            self.due.pop();
            let Some(event) = self.events.get_mut(order as usize).and_then(Option::take) else {
                continue;
            };
            match event {
                WorkerEvent::PrefillDone {
                    worker,
                    tokens,
                    blocks,
                } => {
                    self.flush(worker, at);
                    let w = &mut self.workers[worker];
                    w.prefill_tokens = w.prefill_tokens.saturating_sub(tokens);
                    w.active_blocks = w.active_blocks.saturating_sub(blocks);
                }
                WorkerEvent::Finished {
                    worker,
                    blocks,
                    dispatch,
                } => {
                    self.flush(worker, at);
                    let w = &mut self.workers[worker];
                    w.active_blocks = w.active_blocks.saturating_sub(blocks);
                    if let Some((replica, id)) = dispatch {
                        self.states[replica].ledger.request_ended(id);
                    }
                }
            }
        }
        for worker in 0..self.workers.len() {
            self.flush(worker, t_us);
        }
    }

    /// A seeded unit in `[0, 1)` for softmax sampling.
    fn draw_unit(&mut self) -> f64 {
        self.draws += 1;
        let bits = splitmix64(self.cfg.seed ^ splitmix64(self.draws));
        (bits >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Serves `blocks` on `worker`'s cache: returns the cached prefix (blocks) and applies the
    /// worker's kv-events to the index.
    fn serve_blocks(
        &mut self,
        worker: usize,
        local: &[LocalBlockHash],
        run: &mut PolicyRun,
    ) -> usize {
        let seq: Vec<u64> = sequence_hashes(local).into_iter().map(|s| s.0).collect();
        let w = &mut self.workers[worker];
        let hit = w.lru.prefix(&seq);
        let mut batch = Vec::new();
        if hit < seq.len() {
            let blocks: Vec<StoredBlock> = (hit..seq.len())
                .map(|i| StoredBlock {
                    block_hash: ExternalBlockHash(seq[i]),
                    tokens_hash: local[i],
                    mm_extra_info: None,
                })
                .collect();
            w.event_id += 1;
            batch.push(router_event(
                w.id,
                w.event_id,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: hit.checked_sub(1).map(|p| ExternalBlockHash(seq[p])),
                    start_position: None,
                    blocks: blocks.into(),
                }),
            ));
        }
        // Tail first, so the prefix is the most recent and evicted last.
        for hash in seq.iter().rev() {
            w.lru.touch(*hash);
        }
        let evicted = w.lru.evict();
        if !evicted.is_empty() {
            w.event_id += 1;
            batch.push(router_event(
                w.id,
                w.event_id,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: evicted
                        .into_iter()
                        .map(ExternalBlockHash)
                        .collect::<Vec<_>>()
                        .into(),
                }),
            ));
        }
        for event in &batch {
            if self.index.apply(event) != KvEventResult::Applied {
                run.events_not_applied += 1;
            }
        }
        hit
    }
}

fn router_event(worker: InstanceId, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        residency_domain: Some(ResidencyDomain::Worker),
        event: KvCacheEvent {
            event_id: id,
            data,
            dp_rank: DpRank(0),
        },
        session_id: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{Replicas, fleet_candidates};
    use continuum_protocol::kv::hashing::BlockSize;

    fn config(replicas: Replicas) -> SimConfig {
        let mut cfg = SimConfig::new(2, 1000, BlockSize::new(16).unwrap());
        cfg.replicas = replicas;
        cfg
    }

    fn ms(v: u64) -> Tick {
        Tick(Duration::from_millis(v))
    }

    #[test]
    fn a_load_lag_delays_every_sample_by_the_lag() {
        let cfg = config(Replicas {
            load_lag: Duration::from_millis(30),
            ..Replicas::default()
        });
        let candidates = fleet_candidates(&cfg).unwrap();
        let mut sim = Sim::new(&cfg, &candidates);
        let id = sim.workers[0].id;
        sim.advance(20_000);
        assert_eq!(sim.store.last_arrival(id), None, "tick 0 arrives at 30 ms");
        sim.workers[0].active_blocks = 7;
        sim.advance(60_000);
        // Tick 0 (published before the change) arrived at 30 ms; tick 50 ms is still on its way.
        assert_eq!(sim.store.last_arrival(id), Some(ms(30)));
        let seen = |sim: &Sim<'_>| sim.store.latest(id, DpRank(0)).unwrap().decode_backlog();
        assert_eq!(seen(&sim), Some(0));
        sim.advance(79_999);
        assert_eq!(seen(&sim), Some(0));
        sim.advance(80_000);
        assert_eq!(sim.store.last_arrival(id), Some(ms(80)));
        assert_eq!(seen(&sim), Some(7), "the 50 ms tick, received 30 ms later");
    }

    #[test]
    fn without_a_lag_samples_land_at_their_tick() {
        let cfg = config(Replicas::default());
        let candidates = fleet_candidates(&cfg).unwrap();
        let mut sim = Sim::new(&cfg, &candidates);
        let id = sim.workers[1].id;
        sim.advance(60_000);
        assert_eq!(sim.store.last_arrival(id), Some(ms(50)));
    }

    #[test]
    fn a_shared_dispatch_reaches_only_the_peers_after_the_share_lag() {
        let cfg = config(Replicas {
            count: 3,
            sharing: true,
            share_lag: Duration::from_millis(5),
            ..Replicas::default()
        });
        let candidates = fleet_candidates(&cfg).unwrap();
        let mut sim = Sim::new(&cfg, &candidates);
        let placement = Placement {
            decode: 1,
            prefill: None,
            dispatch: Some(DispatchId(0)),
            replica: 2,
        };
        sim.share(&placement, 64, 10_000);
        sim.advance(14_999);
        let legs = |sim: &Sim<'_>| -> Vec<usize> {
            sim.states.iter().map(|s| s.ledger.pending_legs()).collect()
        };
        assert_eq!(legs(&sim), [0, 0, 0]);
        sim.advance(15_000);
        assert_eq!(legs(&sim), [1, 1, 0], "every peer, not the origin");
        let key = &sim.workers[1].key;
        let backlog = sim.states[0].ledger.backlog(key, DpRank(0), ms(15));
        assert_eq!(backlog.decode_blocks, 4, "64 tokens = 4 blocks of 16");
        assert!(!backlog.stalled);
        // A later sample from the worker answers the copy, as it answers a local dispatch.
        sim.advance(50_000);
        answer_arrivals(&mut sim.states[0].ledger, &sim.store);
        assert_eq!(sim.states[0].ledger.pending_legs(), 0);
    }
}
