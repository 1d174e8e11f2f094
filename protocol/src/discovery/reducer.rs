//! The per-namespace discovery reducer: folds [`SourceEvent`]s into a [`NamespaceView`].
//!
//! The reducer holds records by etcd key and joins and publishes them by an identity read from
//! the value, so every derived fact is a pure function of the held key → value map: the same
//! final key set gives the same view whatever the order of puts and deletes (a property test
//! checks this). Only timestamps remember history, and only on purpose: the reducer lives as
//! long as its watcher, so a worker's `first_seen` survives resyncs.
//!
//! Identities (a generate instance id, a card's `(instance, component, endpoint)`, a legacy
//! card's instance id, a publisher id) claimed by more than one key are refused together: the
//! router cannot tell the genuine record from a forged one, and refusing both is order-free.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use tracing::{debug, warn};

use super::keys::{Keyspace, ParsedKey, classify};
use super::records::{
    CardClaim, CardFields, CardMemo, CardRecord, ChannelRecord, EndpointRecord, MAX_RECORD_BYTES,
    MAX_RECORDS_PER_KEYSPACE, Record, RecordError, Role, SourceRecord, clip, parse_record_with,
};
use super::view::{NamespaceView, Publisher, Worker};
use super::{DiscoveryCounts, DiscoveryEventKind, SourceEvent};
use crate::ids::{InstanceId, Namespace, PublisherId, WorkerKey};
use crate::time::UnixMillis;

/// Keys remembered for "logged once per key"; beyond this, bad records are still counted but
/// no longer logged, so a flood of distinct bad keys cannot grow memory.
const MAX_LOGGED_KEYS: usize = 4 * MAX_RECORDS_PER_KEYSPACE;
/// Keys named in one duplicate warning.
const KEYS_PER_DUPLICATE_LOG: usize = 4;

/// Folds one namespace's discovery events into its fleet view.
#[derive(Debug)]
pub struct DiscoveryReducer {
    namespace: Namespace,
    held: Held,
    staging: Option<Staging>,
    view: Arc<NamespaceView>,
    counts: DiscoveryCounts,
    synced: bool,
    logs: LogState,
    /// Identities currently claimed by several keys (each set logged once).
    conflicts: BTreeMap<Identity, Vec<String>>,
    /// Workers excluded for disagreeing roles: (component role, card role), logged once.
    role_conflicts: BTreeMap<InstanceId, (Role, Role)>,
    /// What changed in the view since the last [`DiscoveryReducer::take_changes`].
    changes: ViewChanges,
    /// The cards parsed last, shared by the workers that publish the same card.
    memo: CardMemo,
    /// The instances whose release string was logged.
    released: ReleaseLog,
}

/// The workers (by instance id) and whether the publishers changed in a view since the consumer
/// last looked: what the registry patches its snapshot with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ViewChanges {
    pub workers: BTreeSet<InstanceId>,
    pub publishers: bool,
}

impl ViewChanges {
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty() && !self.publishers
    }

    /// Folds later changes into these.
    pub fn merge(&mut self, later: ViewChanges) {
        if self.workers.is_empty() {
            self.workers = later.workers;
        } else {
            self.workers.extend(later.workers);
        }
        self.publishers |= later.publishers;
    }
}

impl DiscoveryReducer {
    pub fn new(namespace: Namespace) -> Self {
        Self {
            view: Arc::new(NamespaceView::new(namespace.clone())),
            namespace,
            held: Held::default(),
            staging: None,
            counts: DiscoveryCounts::default(),
            synced: false,
            logs: LogState::default(),
            conflicts: BTreeMap::new(),
            role_conflicts: BTreeMap::new(),
            changes: ViewChanges::default(),
            memo: CardMemo::default(),
            released: ReleaseLog::default(),
        }
    }

    /// The workers and publishers changed in the view since the last call (resyncs included),
    /// drained.
    pub fn take_changes(&mut self) -> ViewChanges {
        std::mem::take(&mut self.changes)
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// The materialised view. Cheap to clone; the reducer copies on write only while a reader
    /// still holds an older `Arc`.
    pub fn view(&self) -> &Arc<NamespaceView> {
        &self.view
    }

    /// True once a resync has completed (the view reflects a full range get).
    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// True between `Init` and `InitDone`.
    pub fn is_resyncing(&self) -> bool {
        self.staging.is_some()
    }

    /// Keys currently held in `keyspace` (records the reducer uses; skipped keys are not held).
    pub fn held_keys(&self, keyspace: Keyspace) -> usize {
        self.held.len(keyspace)
    }

    /// Drains the counts accumulated since the last call.
    pub fn take_counts(&mut self) -> DiscoveryCounts {
        std::mem::take(&mut self.counts)
    }

    /// Folds one event. Returns true iff the materialised view changed (workers or publishers;
    /// an idempotent resync returns false and keeps every timestamp).
    pub fn apply(&mut self, event: SourceEvent, now: UnixMillis) -> bool {
        match event {
            SourceEvent::Init => {
                if self.staging.is_some() {
                    debug!(namespace = %self.namespace, "Restarted an unfinished discovery resync.");
                }
                self.staging = Some(Staging::new(&self.view));
                false
            }
            SourceEvent::InitApply { key, value } => {
                let Some(staging) = self.staging.as_mut() else {
                    debug!(key = %clip(&key), "Took a resync record outside a resync as a put.");
                    return self.put_live(&key, &value, now);
                };
                let outcome = ingest(
                    self.namespace.as_str(),
                    &mut self.memo,
                    &mut self.released,
                    &mut staging.held,
                    Some(&self.held),
                    &key,
                    &value,
                    &mut Dirty::discarded(),
                );
                note(
                    &mut self.counts,
                    &mut self.logs,
                    Some(&mut staging.bad_keys),
                    &key,
                    outcome,
                );
                false
            }
            SourceEvent::InitDone => self.finish_resync(now),
            SourceEvent::Apply { key, value } => {
                if let Some(staging) = self.staging.as_mut() {
                    // A watch event inside a resync is newer than the range get: keep it.
                    ingest(
                        self.namespace.as_str(),
                        &mut self.memo,
                        &mut self.released,
                        &mut staging.held,
                        None,
                        &key,
                        &value,
                        &mut Dirty::discarded(),
                    );
                }
                self.put_live(&key, &value, now)
            }
            SourceEvent::Delete { key } => {
                if let Some(staging) = self.staging.as_mut() {
                    remove_key(
                        self.namespace.as_str(),
                        &mut staging.held,
                        &key,
                        &mut Dirty::discarded(),
                    );
                }
                self.delete_live(&key, now)
            }
        }
    }

    fn put_live(&mut self, key: &str, value: &[u8], now: UnixMillis) -> bool {
        let mut dirty = Dirty::default();
        let outcome = ingest(
            self.namespace.as_str(),
            &mut self.memo,
            &mut self.released,
            &mut self.held,
            None,
            key,
            value,
            &mut dirty,
        );
        if !matches!(outcome, Outcome::Ignored) {
            self.counts.add(DiscoveryEventKind::Put, 1);
        }
        note(&mut self.counts, &mut self.logs, None, key, outcome);
        self.rematerialise(dirty, now)
    }

    fn delete_live(&mut self, key: &str, now: UnixMillis) -> bool {
        let mut dirty = Dirty::default();
        let Some(keyspace) = remove_key(self.namespace.as_str(), &mut self.held, key, &mut dirty)
        else {
            return false;
        };
        self.counts.add(DiscoveryEventKind::Delete, 1);
        self.logs.bad_keys.remove(&key_digest(key));
        if self.held.len(keyspace) < MAX_RECORDS_PER_KEYSPACE {
            self.logs.capacity_logged.remove(&keyspace);
        }
        self.rematerialise(dirty, now)
    }

    fn finish_resync(&mut self, now: UnixMillis) -> bool {
        let Some(staging) = self.staging.take() else {
            debug!(namespace = %self.namespace, "Ignored a resync end without a resync start.");
            return false;
        };
        self.held = staging.held;
        self.held.admission = None;
        let mut dirty = Dirty::default();
        dirty.workers.extend(self.view.workers.keys().copied());
        dirty.workers.extend(self.held.endpoint_ids.keys().copied());
        dirty.workers.extend(self.role_conflicts.keys().copied());
        dirty
            .publishers
            .extend(self.view.publishers.keys().copied());
        dirty
            .publishers
            .extend(self.held.channel_ids.keys().copied());

        let fresh = self.held.all_conflicts();
        for (identity, keys) in &fresh {
            if self.conflicts.get(identity) != Some(keys) {
                log_duplicate(&self.namespace, identity, keys);
                self.counts.add(DiscoveryEventKind::Duplicate, 1);
            }
        }
        self.conflicts = fresh;
        let seen = staging.bad_keys;
        self.logs.bad_keys.retain(|k, _| seen.contains(k));
        for keyspace in Keyspace::ALL {
            if self.held.len(keyspace) < MAX_RECORDS_PER_KEYSPACE {
                self.logs.capacity_logged.remove(&keyspace);
            }
        }
        self.counts.add(DiscoveryEventKind::Resync, 1);
        self.synced = true;
        self.rematerialise(dirty, now)
    }

    fn rematerialise(&mut self, dirty: Dirty, now: UnixMillis) -> bool {
        for identity in &dirty.identities {
            let keys = self.held.identity_keys(identity);
            if keys.len() > 1 {
                if self.conflicts.get(identity).map(Vec::as_slice) != Some(keys) {
                    log_duplicate(&self.namespace, identity, keys);
                    self.counts.add(DiscoveryEventKind::Duplicate, 1);
                    self.conflicts.insert(identity.clone(), keys.to_vec());
                }
            } else if self.conflicts.remove(identity).is_some() {
                debug!(namespace = %self.namespace, identity = ?identity,
                    "Duplicate discovery records resolved; the survivor is used again.");
            }
        }

        let mut worker_changes: Vec<(InstanceId, Option<Arc<Worker>>)> = Vec::new();
        for id in dirty.workers {
            let next = materialise_worker(
                &self.namespace,
                &self.held,
                id,
                &mut self.role_conflicts,
                &mut self.counts,
            );
            match (self.view.workers.get(&id), next) {
                (None, None) => {}
                (Some(_), None) => worker_changes.push((id, None)),
                (None, Some(mut w)) => {
                    w.first_seen = now;
                    w.last_updated = now;
                    worker_changes.push((id, Some(Arc::new(w))));
                }
                (Some(old), Some(mut w)) => {
                    if !old.same_content(&w) {
                        w.first_seen = old.first_seen;
                        w.last_updated = now;
                        worker_changes.push((id, Some(Arc::new(w))));
                    }
                }
            }
        }
        let mut publisher_changes: Vec<(PublisherId, Option<Arc<Publisher>>)> = Vec::new();
        for id in dirty.publishers {
            let next = materialise_publisher(&self.namespace, &self.held, id);
            match (self.view.publishers.get(&id), next) {
                (None, None) => {}
                (Some(old), Some(p)) if **old == p => {}
                (_, next) => publisher_changes.push((id, next.map(Arc::new))),
            }
        }
        if worker_changes.is_empty() && publisher_changes.is_empty() {
            return false;
        }
        // Copies the view only while a reader still holds it (the registry drops the views it
        // was handed once it has patched its snapshot).
        let view = Arc::make_mut(&mut self.view);
        self.changes.publishers |= !publisher_changes.is_empty();
        self.changes
            .workers
            .extend(worker_changes.iter().map(|(id, _)| *id));
        for (id, w) in worker_changes {
            match w {
                Some(w) => view.workers.insert(id, w),
                None => view.workers.remove(&id),
            };
        }
        for (id, p) in publisher_changes {
            match p {
                Some(p) => view.publishers.insert(id, p),
                None => view.publishers.remove(&id),
            };
        }
        true
    }
}

/// Decides a worker's role from its component and card. `Err((component, card))` when both
/// claim a role and disagree.
pub fn decide_role(component: &str, card: Option<&CardFields>) -> Result<Role, (Role, Role)> {
    let by_component = Role::claimed_by_component(component);
    let by_card = match card.map(|c| c.claim) {
        Some(CardClaim::Role(r)) => Some(r),
        Some(CardClaim::Unrecognised) | None => None,
    };
    match (by_component, by_card) {
        (Some(c), Some(k)) if c != k => Err((c, k)),
        (Some(c), _) => Ok(c),
        (None, Some(k)) => Ok(k),
        // No card yet, or a card with no usable claim, beside a component that claims nothing:
        // visible to operators, never routed to.
        (None, None) => Ok(Role::Unknown),
    }
}

fn materialise_worker(
    namespace: &Namespace,
    held: &Held,
    id: InstanceId,
    role_conflicts: &mut BTreeMap<InstanceId, (Role, Role)>,
    counts: &mut DiscoveryCounts,
) -> Option<Worker> {
    let endpoint = match held.endpoint_ids.get(&id).map(Vec::as_slice) {
        Some([only]) => held.endpoints.get(only).map(|s| &s.rec),
        _ => None,
    };
    let Some(endpoint) = endpoint else {
        role_conflicts.remove(&id);
        return None;
    };
    let card = match held.scoped_card_keys(id, &endpoint.component, &endpoint.endpoint) {
        Some(keys) => unique(keys, &held.cards),
        // Legacy cards join on the instance id alone, only when no scoped card exists.
        None => held
            .legacy_cards
            .get(&id)
            .and_then(|keys| unique(keys, &held.cards)),
    };
    let role = match decide_role(&endpoint.component, card.map(|c| &c.fields)) {
        Ok(role) => {
            role_conflicts.remove(&id);
            role
        }
        Err(pair) => {
            if role_conflicts.get(&id) != Some(&pair) {
                warn!(
                    namespace = %namespace,
                    instance_id = %id,
                    component = %endpoint.component,
                    component_role = %pair.0,
                    card_role = %pair.1,
                    "Excluded a worker whose component and card claim different roles."
                );
                counts.add(DiscoveryEventKind::RoleConflict, 1);
                role_conflicts.insert(id, pair);
            }
            return None;
        }
    };
    let fields = card.map(|c| &c.fields);
    Some(Worker {
        key: WorkerKey {
            namespace: namespace.clone(),
            instance_id: id,
        },
        component: endpoint.component.clone(),
        endpoint: endpoint.endpoint.clone(),
        role,
        model: fields.and_then(|f| f.model.clone()),
        block_size: fields.and_then(|f| f.block_size),
        capacity: fields.map(|f| f.capacity).unwrap_or_default(),
        dp_start_rank: fields.and_then(|f| f.dp_start_rank),
        dp_size: fields.and_then(|f| f.dp_size),
        disaggregated_endpoint: fields.and_then(|f| f.disaggregated_endpoint.clone()),
        artifacts: fields.map(|f| f.artifacts.clone()).unwrap_or_default(),
        card: card.and_then(|c| c.card.clone()),
        transport: endpoint.transport.clone(),
        first_seen: UnixMillis::default(),
        last_updated: UnixMillis::default(),
    })
}

/// The record behind an identity claimed by exactly one key.
fn unique<'a, T>(keys: &[String], slots: &'a KeyMap<Slot<T>>) -> Option<&'a T> {
    match keys {
        [only] => slots.get(only).map(|s| s.rec.as_ref()),
        _ => None,
    }
}

fn materialise_publisher(namespace: &Namespace, held: &Held, id: PublisherId) -> Option<Publisher> {
    let channel = unique(held.channel_ids.get(&id)?, &held.channels)?;
    let source = held
        .source_ids
        .get(&id)
        .and_then(|keys| unique(keys, &held.sources));
    Some(Publisher {
        namespace: namespace.clone(),
        component: channel.component.clone(),
        endpoint: channel.endpoint.clone(),
        topic: channel.topic,
        publisher_id: id,
        worker: source.map(|s| WorkerKey {
            namespace: namespace.clone(),
            instance_id: s.worker_id,
        }),
        dp_rank: source.and_then(|s| s.dp_rank),
        address: channel.address.clone(),
    })
}

fn log_duplicate(namespace: &Namespace, identity: &Identity, keys: &[String]) {
    let shown: Vec<String> = keys
        .iter()
        .take(KEYS_PER_DUPLICATE_LOG)
        .map(|k| clip(k))
        .collect();
    warn!(
        namespace = %namespace,
        record = identity.record_kind(),
        identity = %identity.describe(),
        conflicts = keys.len(),
        keys = ?shown,
        "Refused discovery records that claim one identity."
    );
}

// ---------------------------------------------------------------------------------------------
// Held records and their identity indexes.

type Digest = [u8; 32];

/// What a held value is recognised by: its XXH3-128. Not a security boundary, and it need not
/// be one: a value is only ever compared with the value held under the same key, so a
/// collision could only make the router keep the record it already holds for a key, which
/// whoever can write that key could have written anyway. It makes an unchanged put (and an
/// idempotent resync) cost a hash per record at memory speed; a cryptographic digest was a
/// quarter of a resync's reducer time.
type ValueDigest = u128;

fn value_digest(value: &[u8]) -> ValueDigest {
    xxhash_rust::xxh3::xxh3_128(value)
}

#[derive(Debug)]
struct Slot<T> {
    digest: ValueDigest,
    rec: Arc<T>,
}

#[derive(Clone, Debug)]
enum HeldRecord {
    Endpoint(Arc<EndpointRecord>),
    Card(Arc<CardRecord>),
    Channel(Arc<ChannelRecord>),
    Source(Arc<SourceRecord>),
}

impl HeldRecord {
    fn card_trimmed(&self) -> bool {
        matches!(self, HeldRecord::Card(c) if c.card_trimmed)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Identity {
    Generate(InstanceId),
    ScopedCard(InstanceId, String, String),
    LegacyCard(InstanceId),
    Channel(PublisherId),
    Source(PublisherId),
}

impl Identity {
    fn record_kind(&self) -> &'static str {
        match self {
            Identity::Generate(_) => "generate endpoint",
            Identity::ScopedCard(..) => "base card",
            Identity::LegacyCard(_) => "legacy card",
            Identity::Channel(_) => "event channel",
            Identity::Source(_) => "event source",
        }
    }

    fn describe(&self) -> String {
        match self {
            Identity::Generate(id) | Identity::LegacyCard(id) => format!("instance {id}"),
            Identity::ScopedCard(id, c, e) => format!("instance {id} at {c}/{e}"),
            Identity::Channel(p) | Identity::Source(p) => format!("publisher {p}"),
        }
    }

    /// The worker an endpoint or card identity names.
    fn worker(&self) -> Option<InstanceId> {
        match self {
            Identity::Generate(id) | Identity::ScopedCard(id, ..) | Identity::LegacyCard(id) => {
                Some(*id)
            }
            Identity::Channel(_) | Identity::Source(_) => None,
        }
    }

    fn mark(&self, dirty: &mut Dirty) {
        if dirty.discard {
            return;
        }
        match self {
            Identity::Generate(id) | Identity::ScopedCard(id, ..) | Identity::LegacyCard(id) => {
                dirty.workers.insert(*id);
            }
            Identity::Channel(p) | Identity::Source(p) => {
                dirty.publishers.insert(*p);
            }
        }
        dirty.identities.insert(self.clone());
    }
}

#[derive(Debug, Default)]
struct Dirty {
    workers: BTreeSet<InstanceId>,
    publishers: BTreeSet<PublisherId>,
    identities: BTreeSet<Identity>,
    /// Nothing is recorded: a staging set's changes are all re-derived when the resync ends.
    discard: bool,
}

impl Dirty {
    fn discarded() -> Self {
        Self {
            discard: true,
            ..Self::default()
        }
    }
}

/// Records by etcd key. The fleet writes the keys, so the hash is keyed with per-process random
/// keys (aHash's, built to resist collision flooding, as std's SipHash is); a resync hashes
/// every key at least twice and again at each growth of the map, where SipHash was 14 % of the
/// reducer's time.
type KeyMap<V> = HashMap<String, V, ahash::RandomState>;

#[derive(Debug, Default)]
struct Held {
    /// Set on a resync's staging set only: its capacity evicts by [`Rank`] instead of refusing.
    admission: Option<Box<Admission>>,
    // Held records by key: hashed, looked up several times per put and never walked in order.
    endpoints: KeyMap<Slot<EndpointRecord>>,
    cards: KeyMap<Slot<CardRecord>>,
    channels: KeyMap<Slot<ChannelRecord>>,
    sources: KeyMap<Slot<SourceRecord>>,
    endpoint_ids: BTreeMap<InstanceId, Vec<String>>,
    /// Scoped cards by instance, component and endpoint (nested so a lookup borrows the
    /// names; no inner map is ever empty).
    scoped_cards: BTreeMap<InstanceId, BTreeMap<String, BTreeMap<String, Vec<String>>>>,
    legacy_cards: BTreeMap<InstanceId, Vec<String>>,
    channel_ids: BTreeMap<PublisherId, Vec<String>>,
    source_ids: BTreeMap<PublisherId, Vec<String>>,
}

fn index_add<K: Ord>(index: &mut BTreeMap<K, Vec<String>>, id: K, key: &str) {
    let keys = index.entry(id).or_default();
    if let Err(at) = keys.binary_search_by(|k| k.as_str().cmp(key)) {
        keys.insert(at, key.to_owned());
    }
}

fn index_remove<K: Ord>(index: &mut BTreeMap<K, Vec<String>>, id: &K, key: &str) {
    if let Some(keys) = index.get_mut(id) {
        keys.retain(|k| k != key);
        if keys.is_empty() {
            index.remove(id);
        }
    }
}

/// The value under `name`, inserted empty when absent; the owned name is built only then (an
/// `entry` builds it for every lookup). `None` only if the map lost what was just inserted.
fn named_entry<'a, V: Default>(map: &'a mut BTreeMap<String, V>, name: &str) -> Option<&'a mut V> {
    if !map.contains_key(name) {
        map.insert(name.to_owned(), V::default());
    }
    map.get_mut(name)
}

fn scoped_add(held: &mut Held, card: &CardRecord, key: &str) {
    let components = held.scoped_cards.entry(card.instance_id).or_default();
    let Some(keys) = named_entry(components, &card.component)
        .and_then(|endpoints| named_entry(endpoints, &card.endpoint))
    else {
        return;
    };
    if let Err(at) = keys.binary_search_by(|k| k.as_str().cmp(key)) {
        keys.insert(at, key.to_owned());
    }
}

fn scoped_remove(held: &mut Held, card: &CardRecord, key: &str) {
    let Some(components) = held.scoped_cards.get_mut(&card.instance_id) else {
        return;
    };
    if let Some(endpoints) = components.get_mut(card.component.as_str()) {
        if let Some(keys) = endpoints.get_mut(card.endpoint.as_str()) {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                endpoints.remove(card.endpoint.as_str());
            }
        }
        if endpoints.is_empty() {
            components.remove(card.component.as_str());
        }
    }
    if components.is_empty() {
        held.scoped_cards.remove(&card.instance_id);
    }
}

fn card_identity(card: &CardRecord) -> Identity {
    if card.is_legacy() {
        Identity::LegacyCard(card.instance_id)
    } else {
        Identity::ScopedCard(
            card.instance_id,
            card.component.clone(),
            card.endpoint.clone(),
        )
    }
}

impl Held {
    /// The keys `keyspace` holds, in no particular order.
    fn keys(&self, keyspace: Keyspace) -> Box<dyn Iterator<Item = &String> + '_> {
        match keyspace {
            Keyspace::Instances => Box::new(self.endpoints.keys()),
            Keyspace::Cards => Box::new(self.cards.keys()),
            Keyspace::Channels => Box::new(self.channels.keys()),
            Keyspace::Sources => Box::new(self.sources.keys()),
        }
    }

    fn len(&self, keyspace: Keyspace) -> usize {
        match keyspace {
            Keyspace::Instances => self.endpoints.len(),
            Keyspace::Cards => self.cards.len(),
            Keyspace::Channels => self.channels.len(),
            Keyspace::Sources => self.sources.len(),
        }
    }

    fn contains(&self, keyspace: Keyspace, key: &str) -> bool {
        self.digest(keyspace, key).is_some()
    }

    fn digest(&self, keyspace: Keyspace, key: &str) -> Option<ValueDigest> {
        match keyspace {
            Keyspace::Instances => self.endpoints.get(key).map(|s| s.digest),
            Keyspace::Cards => self.cards.get(key).map(|s| s.digest),
            Keyspace::Channels => self.channels.get(key).map(|s| s.digest),
            Keyspace::Sources => self.sources.get(key).map(|s| s.digest),
        }
    }

    fn record(&self, keyspace: Keyspace, key: &str) -> Option<HeldRecord> {
        match keyspace {
            Keyspace::Instances => self
                .endpoints
                .get(key)
                .map(|s| HeldRecord::Endpoint(s.rec.clone())),
            Keyspace::Cards => self.cards.get(key).map(|s| HeldRecord::Card(s.rec.clone())),
            Keyspace::Channels => self
                .channels
                .get(key)
                .map(|s| HeldRecord::Channel(s.rec.clone())),
            Keyspace::Sources => self
                .sources
                .get(key)
                .map(|s| HeldRecord::Source(s.rec.clone())),
        }
    }

    fn identity_keys(&self, identity: &Identity) -> &[String] {
        let keys = match identity {
            Identity::Generate(id) => self.endpoint_ids.get(id),
            Identity::ScopedCard(id, c, e) => self.scoped_card_keys(*id, c, e),
            Identity::LegacyCard(id) => self.legacy_cards.get(id),
            Identity::Channel(p) => self.channel_ids.get(p),
            Identity::Source(p) => self.source_ids.get(p),
        };
        keys.map(Vec::as_slice).unwrap_or_default()
    }

    fn all_conflicts(&self) -> BTreeMap<Identity, Vec<String>> {
        let mut out = BTreeMap::new();
        let many = |keys: &&Vec<String>| keys.len() > 1;
        for (id, keys) in self.endpoint_ids.iter().filter(|(_, k)| many(k)) {
            out.insert(Identity::Generate(*id), keys.clone());
        }
        for (id, components) in &self.scoped_cards {
            for (c, endpoints) in components {
                for (e, keys) in endpoints.iter().filter(|(_, k)| many(k)) {
                    out.insert(
                        Identity::ScopedCard(*id, c.clone(), e.clone()),
                        keys.clone(),
                    );
                }
            }
        }
        for (id, keys) in self.legacy_cards.iter().filter(|(_, k)| many(k)) {
            out.insert(Identity::LegacyCard(*id), keys.clone());
        }
        for (id, keys) in self.channel_ids.iter().filter(|(_, k)| many(k)) {
            out.insert(Identity::Channel(*id), keys.clone());
        }
        for (id, keys) in self.source_ids.iter().filter(|(_, k)| many(k)) {
            out.insert(Identity::Source(*id), keys.clone());
        }
        out
    }

    fn remove(&mut self, keyspace: Keyspace, key: &str, dirty: &mut Dirty) -> bool {
        let identity = match keyspace {
            Keyspace::Instances => self.endpoints.remove(key).map(|s| {
                if let Some(admission) = self.admission.as_mut() {
                    admission.scope_changed(&s.rec, false);
                }
                index_remove(&mut self.endpoint_ids, &s.rec.instance_id, key);
                Identity::Generate(s.rec.instance_id)
            }),
            Keyspace::Cards => self.cards.remove(key).map(|s| {
                if s.rec.is_legacy() {
                    index_remove(&mut self.legacy_cards, &s.rec.instance_id, key);
                } else {
                    scoped_remove(self, &s.rec, key);
                }
                card_identity(&s.rec)
            }),
            Keyspace::Channels => self.channels.remove(key).map(|s| {
                index_remove(&mut self.channel_ids, &s.rec.publisher_id, key);
                Identity::Channel(s.rec.publisher_id)
            }),
            Keyspace::Sources => self.sources.remove(key).map(|s| {
                index_remove(&mut self.source_ids, &s.rec.publisher_id, key);
                Identity::Source(s.rec.publisher_id)
            }),
        };
        match identity {
            Some(identity) => {
                self.after_change(keyspace, key, identity.worker());
                identity.mark(dirty);
                true
            }
            None => false,
        }
    }

    /// Holds `rec` under `key`, which `self` does not hold (the caller removed it or found it
    /// absent: one hash of the key per put instead of a lookup before every step).
    fn insert_absent(
        &mut self,
        keyspace: Keyspace,
        key: &str,
        digest: ValueDigest,
        rec: HeldRecord,
        dirty: &mut Dirty,
    ) {
        debug_assert!(!self.contains(keyspace, key));
        let worker = match rec {
            HeldRecord::Endpoint(rec) => {
                if let Some(admission) = self.admission.as_mut() {
                    admission.scope_changed(&rec, true);
                }
                index_add(&mut self.endpoint_ids, rec.instance_id, key);
                Identity::Generate(rec.instance_id).mark(dirty);
                let id = rec.instance_id;
                self.endpoints.insert(key.to_owned(), Slot { digest, rec });
                Some(id)
            }
            HeldRecord::Card(rec) => {
                if rec.is_legacy() {
                    index_add(&mut self.legacy_cards, rec.instance_id, key);
                } else {
                    scoped_add(self, &rec, key);
                }
                // A scoped card's identity copies two names: built only where it is recorded.
                if !dirty.discard {
                    card_identity(&rec).mark(dirty);
                }
                let id = rec.instance_id;
                self.cards.insert(key.to_owned(), Slot { digest, rec });
                Some(id)
            }
            HeldRecord::Channel(rec) => {
                index_add(&mut self.channel_ids, rec.publisher_id, key);
                Identity::Channel(rec.publisher_id).mark(dirty);
                self.channels.insert(key.to_owned(), Slot { digest, rec });
                None
            }
            HeldRecord::Source(rec) => {
                index_add(&mut self.source_ids, rec.publisher_id, key);
                Identity::Source(rec.publisher_id).mark(dirty);
                self.sources.insert(key.to_owned(), Slot { digest, rec });
                None
            }
        };
        self.after_change(keyspace, key, worker);
    }
}

#[derive(Debug, Default)]
struct Staging {
    held: Held,
    /// Digests of keys found bad during this resync, so log-once state can forget the others.
    bad_keys: BTreeSet<Digest>,
}

impl Staging {
    /// A fresh staging set whose admission remembers what `live` publishes.
    fn new(live: &NamespaceView) -> Self {
        let admission = Admission {
            workers: live.workers.keys().copied().collect(),
            publishers: live.publishers.keys().copied().collect(),
            order: Default::default(),
            scopes: BTreeMap::new(),
        };
        Self {
            held: Held {
                admission: Some(Box::new(admission)),
                ..Held::default()
            },
            bad_keys: BTreeSet::new(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bounded admission during a resync.
//
// The range get of a resync arrives in key order, which the fleet controls: filled first come
// first served, low-id junk keys would push out every real worker. While staging, a keyspace at
// `MAX_RECORDS_PER_KEYSPACE` therefore keeps the best records by `(Rank, key)` instead: a
// newcomer that ranks better than the worst held record evicts it, and either way exactly one
// record is left out and counted `over_capacity`. Ranks are re-evaluated whenever a partner
// record (the card of an endpoint, the endpoint of a card) arrives or leaves; a channel joins
// when a held endpoint lies in its scope. Ranks are kept only for a keyspace that has reached
// capacity during the resync: every record it holds is ranked once at that moment (the same
// ranks the records' current partners give), so a resync under capacity ranks nothing.

/// How much a held record is worth keeping; lower is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    /// Joins no partner: an endpoint without a card, a card or channel without an endpoint.
    orphan: bool,
    /// Not part of what the live view publishes (a worker or publisher admitted before).
    new: bool,
}

impl Rank {
    const ALL: [Rank; 4] = [
        Rank {
            orphan: false,
            new: false,
        },
        Rank {
            orphan: false,
            new: true,
        },
        Rank {
            orphan: true,
            new: false,
        },
        Rank {
            orphan: true,
            new: true,
        },
    ];
}

#[derive(Debug)]
struct Admission {
    /// Workers of the live view when the resync started.
    workers: BTreeSet<InstanceId>,
    /// Publishers of the live view when the resync started.
    publishers: BTreeSet<PublisherId>,
    /// Held keys per keyspace, best first: `None` until the keyspace first reaches capacity
    /// (only then is a record ever chosen by rank), built then from every record it holds and
    /// kept in step after. A resync that stays under capacity never ranks a record.
    order: [Option<BTreeSet<(Rank, String)>>; 4],
    /// Held generate endpoints per component and endpoint, for channels to join (nested so a
    /// lookup borrows the record's names; no inner map is ever empty).
    scopes: BTreeMap<String, BTreeMap<String, usize>>,
}

impl Admission {
    fn scope_changed(&mut self, rec: &EndpointRecord, added: bool) {
        let (component, endpoint) = (rec.component.as_str(), rec.endpoint.as_str());
        if added {
            if let Some(n) = named_entry(&mut self.scopes, component)
                .and_then(|endpoints| named_entry(endpoints, endpoint))
            {
                *n += 1;
            }
            return;
        }
        let Some(endpoints) = self.scopes.get_mut(component) else {
            return;
        };
        if let Some(n) = endpoints.get_mut(endpoint) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                endpoints.remove(endpoint);
            }
        }
        if endpoints.is_empty() {
            self.scopes.remove(component);
        }
    }

    /// Whether a held endpoint lies in a channel's scope (an EventChannel's id is a publisher
    /// id, not a worker id: its scope is what ties it to workers).
    fn scope_has_endpoint(&self, component: Option<&str>, endpoint: Option<&str>) -> bool {
        match (component, endpoint) {
            (Some(c), Some(e)) => self
                .scopes
                .get(c)
                .is_some_and(|endpoints| endpoints.contains_key(e)),
            (Some(c), None) => self.scopes.contains_key(c),
            (None, _) => !self.scopes.is_empty(),
        }
    }

    fn forget(&mut self, keyspace: Keyspace, key: &str) {
        let Some(set) = self.order[keyspace_slot(keyspace)].as_mut() else {
            return;
        };
        let mut probe = (Rank::ALL[0], key.to_owned());
        for rank in Rank::ALL {
            probe.0 = rank;
            if set.remove(&probe) {
                return;
            }
        }
    }
}

fn keyspace_slot(keyspace: Keyspace) -> usize {
    match keyspace {
        Keyspace::Instances => 0,
        Keyspace::Cards => 1,
        Keyspace::Channels => 2,
        Keyspace::Sources => 3,
    }
}

impl Held {
    /// The keys claiming the scoped card `(id, component, endpoint)`, found without building
    /// an owned map key (an instance has a handful of scopes at most).
    fn scoped_card_keys(
        &self,
        id: InstanceId,
        component: &str,
        endpoint: &str,
    ) -> Option<&Vec<String>> {
        self.scoped_cards.get(&id)?.get(component)?.get(endpoint)
    }

    fn has_card(&self, id: InstanceId) -> bool {
        self.legacy_cards.contains_key(&id) || self.scoped_cards.contains_key(&id)
    }

    fn rank(&self, admission: &Admission, rec: &HeldRecord) -> Rank {
        let (orphan, admitted) = match rec {
            HeldRecord::Endpoint(r) => (
                !self.has_card(r.instance_id),
                admission.workers.contains(&r.instance_id),
            ),
            HeldRecord::Card(r) => (
                !self.endpoint_ids.contains_key(&r.instance_id),
                admission.workers.contains(&r.instance_id),
            ),
            HeldRecord::Channel(r) => (
                !admission.scope_has_endpoint(r.component.as_deref(), r.endpoint.as_deref()),
                admission.publishers.contains(&r.publisher_id),
            ),
            HeldRecord::Source(r) => (
                !self.endpoint_ids.contains_key(&r.worker_id),
                admission.publishers.contains(&r.publisher_id),
            ),
        };
        Rank {
            orphan,
            new: !admitted,
        }
    }

    /// Whether the admission order of `keyspace` is kept (a resync whose keyspace reached
    /// capacity).
    fn ordered(&self, keyspace: Keyspace) -> bool {
        self.admission
            .as_ref()
            .is_some_and(|a| a.order[keyspace_slot(keyspace)].is_some())
    }

    /// Re-files one held key under its current rank (no-op outside a resync or while its
    /// keyspace is unordered).
    fn rerank(&mut self, keyspace: Keyspace, key: &str) {
        if !self.ordered(keyspace) {
            return;
        }
        let Some(mut admission) = self.admission.take() else {
            return;
        };
        admission.forget(keyspace, key);
        if let Some(rec) = self.record(keyspace, key) {
            let rank = self.rank(&admission, &rec);
            if let Some(set) = admission.order[keyspace_slot(keyspace)].as_mut() {
                set.insert((rank, key.to_owned()));
            }
        }
        self.admission = Some(admission);
    }

    /// Ranks every record `keyspace` holds, once, when a resync first needs to choose among
    /// them (no-op outside a resync or once ordered).
    fn order_keyspace(&mut self, keyspace: Keyspace) {
        let Some(mut admission) = self.admission.take() else {
            return;
        };
        if admission.order[keyspace_slot(keyspace)].is_none() {
            let mut set = BTreeSet::new();
            for key in self.keys(keyspace) {
                if let Some(rec) = self.record(keyspace, key) {
                    set.insert((self.rank(&admission, &rec), key.clone()));
                }
            }
            admission.order[keyspace_slot(keyspace)] = Some(set);
        }
        self.admission = Some(admission);
    }

    /// Re-files every held record that joins worker `id`: its endpoints and cards. A channel's
    /// rank is taken when its keyspace is first ordered or, after that, when it arrives (the
    /// etcd source reads channels after endpoints).
    fn rerank_worker(&mut self, id: InstanceId) {
        if !self.ordered(Keyspace::Instances) && !self.ordered(Keyspace::Cards) {
            return;
        }
        let mut keys: Vec<(Keyspace, String)> = Vec::new();
        for key in self.endpoint_ids.get(&id).into_iter().flatten() {
            keys.push((Keyspace::Instances, key.clone()));
        }
        let scoped = self
            .scoped_cards
            .get(&id)
            .into_iter()
            .flat_map(|components| components.values())
            .flat_map(|endpoints| endpoints.values())
            .flatten();
        for key in scoped.chain(self.legacy_cards.get(&id).into_iter().flatten()) {
            keys.push((Keyspace::Cards, key.clone()));
        }
        for (keyspace, key) in keys {
            self.rerank(keyspace, &key);
        }
    }

    /// At capacity during a resync: the held key `rec` (under `key`) would evict, if it ranks
    /// better than the worst one held. `None` outside a resync or when the newcomer is worst.
    fn eviction_candidate(
        &mut self,
        keyspace: Keyspace,
        key: &str,
        rec: &HeldRecord,
    ) -> Option<String> {
        self.order_keyspace(keyspace);
        let admission = self.admission.as_ref()?;
        let rank = self.rank(admission, rec);
        let (worst_rank, worst_key) = admission.order[keyspace_slot(keyspace)].as_ref()?.last()?;
        ((rank, key) < (*worst_rank, worst_key.as_str())).then(|| worst_key.clone())
    }

    /// Keeps the admission order in step after `key` changed; `worker`: the instance its
    /// identity names, if any ([`Identity::worker`]).
    fn after_change(&mut self, keyspace: Keyspace, key: &str, worker: Option<InstanceId>) {
        if self.admission.is_none() {
            return;
        }
        if let Some(admission) = self.admission.as_mut() {
            admission.forget(keyspace, key);
        }
        match worker {
            Some(id) => self.rerank_worker(id),
            None => self.rerank(keyspace, key),
        }
    }
}

#[derive(Debug, Default)]
struct LogState {
    /// Digest of a key → hash of the reason last logged for it (digests keep this small
    /// whatever the key lengths).
    bad_keys: BTreeMap<Digest, u64>,
    capacity_logged: BTreeSet<Keyspace>,
}

/// The worker instances whose card's release string was logged: once per instance, not on
/// every re-parse of its card. Bounded: at [`MAX_RECORDS_PER_KEYSPACE`] instances it forgets
/// them all (a later card may then be logged once more).
#[derive(Debug, Default)]
struct ReleaseLog {
    logged: BTreeSet<InstanceId>,
}

impl ReleaseLog {
    /// Logs `release` for `instance` at debug, unless it was logged before.
    fn note(&mut self, namespace: &str, instance: InstanceId, release: &str) {
        if self.logged.contains(&instance) {
            return;
        }
        if self.logged.len() >= MAX_RECORDS_PER_KEYSPACE {
            self.logged.clear();
        }
        self.logged.insert(instance);
        debug!(namespace, instance_id = %instance, %release,
            "Worker card carries a release string.");
    }
}

/// What one put did to a held set.
#[derive(Debug)]
enum Outcome {
    /// Outside this namespace or the watched buckets.
    Ignored,
    /// Same bytes as the held value.
    Unchanged,
    Held,
    /// Held, with the opaque card dropped for size.
    HeldTrimmed,
    /// Skipped on purpose (non-generate endpoint, LoRA card, other topic): no count, no log.
    Skipped,
    Bad {
        kind: DiscoveryEventKind,
        reason: String,
    },
    OverCapacity(Keyspace),
    /// Held at capacity by evicting a worse-ranked key of a resync (which is left out instead).
    HeldEvicting {
        keyspace: Keyspace,
        trimmed: bool,
    },
}

/// Folds one put into `held`. `reuse` is the live set during a resync: an unchanged value reuses
/// the live parse (and its `Arc`ed card), so an idempotent resync costs a hash per record.
#[allow(clippy::too_many_arguments)]
fn ingest(
    namespace: &str,
    memo: &mut CardMemo,
    released: &mut ReleaseLog,
    held: &mut Held,
    reuse: Option<&Held>,
    key: &str,
    value: &[u8],
    dirty: &mut Dirty,
) -> Outcome {
    let Some((keyspace, parsed)) = classify(namespace, key) else {
        return Outcome::Ignored;
    };
    let parsed: ParsedKey = match parsed {
        Ok(p) => p,
        Err(error) => {
            held.remove(keyspace, key, dirty);
            return Outcome::Bad {
                kind: DiscoveryEventKind::Malformed,
                reason: error.to_string(),
            };
        }
    };
    if value.len() > MAX_RECORD_BYTES {
        held.remove(keyspace, key, dirty);
        return Outcome::Bad {
            kind: DiscoveryEventKind::Oversized,
            reason: RecordError::Oversized(value.len()).to_string(),
        };
    }
    let digest = value_digest(value);
    let held_digest = held.digest(keyspace, key);
    if held_digest == Some(digest) {
        return Outcome::Unchanged;
    }
    let is_held = held_digest.is_some();
    let reused = reuse
        .filter(|live| live.digest(keyspace, key) == Some(digest))
        .and_then(|live| live.record(keyspace, key));
    let record = match reused {
        Some(rec) => rec,
        None => match parse_record_with(&parsed, value, memo) {
            Ok(Record::Endpoint(r)) => HeldRecord::Endpoint(Arc::new(r)),
            Ok(Record::Card(r)) => {
                if let Some(release) = &r.fields.release {
                    released.note(namespace, r.instance_id, release);
                }
                HeldRecord::Card(Arc::new(r))
            }
            Ok(Record::Channel(r)) => HeldRecord::Channel(Arc::new(r)),
            Ok(Record::Source(r)) => HeldRecord::Source(Arc::new(r)),
            Ok(Record::Skipped(_)) => {
                held.remove(keyspace, key, dirty);
                return Outcome::Skipped;
            }
            Err(error) => {
                held.remove(keyspace, key, dirty);
                let kind = match &error {
                    RecordError::Oversized(_) => DiscoveryEventKind::Oversized,
                    e if e.is_unsupported() => DiscoveryEventKind::Unsupported,
                    _ => DiscoveryEventKind::Malformed,
                };
                return Outcome::Bad {
                    kind,
                    reason: error.to_string(),
                };
            }
        },
    };
    let trimmed = record.card_trimmed();
    if is_held {
        held.remove(keyspace, key, dirty);
    } else if held.len(keyspace) >= MAX_RECORDS_PER_KEYSPACE {
        let Some(worst) = held.eviction_candidate(keyspace, key, &record) else {
            return Outcome::OverCapacity(keyspace);
        };
        debug!(namespace, kept = %clip(key), left_out = %clip(&worst),
            "Resync at keyspace capacity: a better-ranked record replaced a worse one.");
        held.remove(keyspace, &worst, dirty);
        held.insert_absent(keyspace, key, digest, record, dirty);
        return Outcome::HeldEvicting { keyspace, trimmed };
    }
    held.insert_absent(keyspace, key, digest, record, dirty);
    if trimmed {
        Outcome::HeldTrimmed
    } else {
        Outcome::Held
    }
}

/// Removes `key` from `held`; `None` when the key is outside this namespace.
fn remove_key(namespace: &str, held: &mut Held, key: &str, dirty: &mut Dirty) -> Option<Keyspace> {
    let (keyspace, _) = classify(namespace, key)?;
    held.remove(keyspace, key, dirty);
    Some(keyspace)
}

/// Counts and logs an outcome (logs once per key and reason, once per keyspace at capacity).
fn note(
    counts: &mut DiscoveryCounts,
    logs: &mut LogState,
    staging_bad: Option<&mut BTreeSet<Digest>>,
    key: &str,
    outcome: Outcome,
) {
    let (kind, reason) = match outcome {
        Outcome::Ignored | Outcome::Unchanged => return,
        Outcome::Held | Outcome::Skipped => {
            // Usually empty: no key digest (BLAKE3) per good record then.
            if !logs.bad_keys.is_empty() {
                logs.bad_keys.remove(&key_digest(key));
            }
            return;
        }
        Outcome::OverCapacity(keyspace) => {
            note_over_capacity(counts, logs, keyspace);
            return;
        }
        Outcome::HeldEvicting { keyspace, trimmed } => {
            note_over_capacity(counts, logs, keyspace);
            let held = if trimmed {
                Outcome::HeldTrimmed
            } else {
                Outcome::Held
            };
            return note(counts, logs, staging_bad, key, held);
        }
        Outcome::HeldTrimmed => (
            DiscoveryEventKind::Oversized,
            "model card exceeds MAX_RETAINED_CARD_BYTES; kept its typed subset only".to_owned(),
        ),
        Outcome::Bad { kind, reason } => (kind, reason),
    };
    counts.add(kind, 1);
    let digest = key_digest(key);
    if let Some(seen) = staging_bad
        && seen.len() < MAX_LOGGED_KEYS
    {
        seen.insert(digest);
    }
    let reason_hash = xxhash_rust::xxh3::xxh3_64(reason.as_bytes());
    let already = logs.bad_keys.get(&digest) == Some(&reason_hash);
    if already || (!logs.bad_keys.contains_key(&digest) && logs.bad_keys.len() >= MAX_LOGGED_KEYS) {
        return;
    }
    warn!(key = %clip(key), kind = kind.as_label(), %reason, "Dropped a discovery record.");
    logs.bad_keys.insert(digest, reason_hash);
}

/// One key left out of a keyspace at capacity: counted, and logged once per keyspace.
fn note_over_capacity(counts: &mut DiscoveryCounts, logs: &mut LogState, keyspace: Keyspace) {
    counts.add(DiscoveryEventKind::OverCapacity, 1);
    if logs.capacity_logged.insert(keyspace) {
        warn!(
            keyspace = keyspace.as_str(),
            limit = MAX_RECORDS_PER_KEYSPACE,
            "Refused new discovery keys: the keyspace is at capacity."
        );
    }
}

fn key_digest(key: &str) -> Digest {
    blake3::hash(key.as_bytes()).into()
}
