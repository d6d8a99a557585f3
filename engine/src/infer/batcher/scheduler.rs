//! The batcher's choices as plain code, with no device, model or channel:
//! which waiting request takes which slot, starting from which cached
//! prefix and reading which adapter table entry; which prompt chunk runs
//! beside which decode rows; and what a step's sampled tokens do to the
//! requests. The scheduling thread asks a [`Scheduler`] for a [`Plan`],
//! runs the programs it names (a prefix copy, an adapter upload, the
//! step) and records what they sampled, so that every choice can be
//! tested here without PJRT.

use std::collections::VecDeque;

use super::{decode_buckets, prefill_bucket, BatcherOptions, FinishReason, SubmitError};

/// What the scheduler decides within: the batcher's options it reads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// KV cache rows: requests running at once.
    pub slots: usize,
    /// Adapter table entries (besides entry 0, the base model's).
    pub entries: usize,
    /// Each slot's cache length.
    pub max_model_len: i64,
    /// The token budget of a step.
    pub max_num_batched_tokens: usize,
    /// Reuse a prefix another slot holds instead of computing it again.
    pub prefix_caching: bool,
}

impl Limits {
    pub(crate) fn of(o: &BatcherOptions) -> Limits {
        Limits {
            slots: o.max_batch_size,
            entries: o.max_loras,
            max_model_len: o.max_model_len,
            max_num_batched_tokens: o.max_num_batched_tokens,
            prefix_caching: o.prefix_caching,
        }
    }
}

/// The largest chunk of a step without decode rows: the token budget
/// rounded down to a power of two (at least 16, the smallest prompt
/// bucket), so that a few programs cover every chunk.
pub(crate) fn chunk_alone(budget: usize) -> usize {
    1 << budget.max(16).ilog2()
}

/// The largest chunk beside decode rows: half the budget, likewise, so
/// that an arriving prompt never stalls running streams for long.
pub(crate) fn chunk_beside_decode(budget: usize) -> usize {
    1 << (budget / 2).max(16).ilog2()
}

/// Refuses a request when `queued` requests already wait and the queue
/// holds `max_queue`.
pub(crate) fn queue_room(queued: usize, max_queue: usize) -> Result<(), SubmitError> {
    if queued >= max_queue {
        return Err(SubmitError::QueueFull(queued));
    }
    Ok(())
}

/// A request as the scheduler sees it; `payload` is the rest, its
/// caller's (the channel, the sampling settings), carried along.
#[derive(Debug)]
pub(crate) struct Request<T> {
    pub prompt: Vec<u32>,
    /// Its adapter's registration id; None for the base model.
    pub adapter: Option<u64>,
    pub max_tokens: usize,
    /// Tokens that end the completion (included in it).
    pub stop_ids: Vec<u32>,
    pub payload: T,
}

/// Where a running request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// `prefilled` prompt tokens have their keys and values in the slot.
    Prefilling { prefilled: usize },
    /// The whole prompt is in; input token `last` goes at `position`.
    Decoding { position: i64, last: u32 },
}

/// A request in a slot.
#[derive(Debug)]
pub(crate) struct Running<T> {
    pub request: Request<T>,
    /// The adapter table entry it reads (0: none, the base model).
    pub entry: usize,
    /// When it took its slot: prefills go first come, first served.
    pub admitted: u64,
    pub phase: Phase,
    pub generated: usize,
}

impl<T> Running<T> {
    /// Takes the program's `next` for this request, whose next input then
    /// goes at `position`: a token (the last one at a stop token or
    /// `max_tokens`), or none when it is not a token of the `vocab` (the
    /// programs' -1 for logits that are not finite).
    fn take(&mut self, next: i32, vocab: i64, position: i64) -> Sampled {
        let Some(token) = u32::try_from(next).ok().filter(|&t| i64::from(t) < vocab) else {
            return Sampled::NotFinite;
        };
        self.generated += 1;
        self.phase = Phase::Decoding {
            position,
            last: token,
        };
        if self.request.stop_ids.contains(&token) {
            Sampled::Last(token, FinishReason::Stop)
        } else if self.generated >= self.request.max_tokens {
            Sampled::Last(token, FinishReason::Length)
        } else {
            Sampled::Token(token)
        }
    }
}

/// What a slot's cache row holds, for prefix reuse: the keys and values of
/// `tokens` (from position 0) under `adapter` (None: the base model). Kept
/// after its request leaves, until the slot is taken.
#[derive(Clone, Debug, Default)]
struct Held {
    adapter: Option<u64>,
    tokens: Vec<u32>,
}

/// A table entry holding an adapter, and when a request last took it.
#[derive(Clone, Copy, Debug)]
struct Entry {
    adapter: u64,
    used: u64,
}

/// Where a request's adapter is in the tables (entries count from 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Already in this entry: nothing to load.
    Resident(usize),
    /// To be loaded into this free entry.
    Free(usize),
    /// To be loaded into `entry`, replacing `adapter`: the least recently
    /// used one no running request reads.
    Evict { entry: usize, adapter: u64 },
}

impl Placement {
    pub(crate) fn entry(self) -> usize {
        match self {
            Placement::Resident(e) | Placement::Free(e) | Placement::Evict { entry: e, .. } => e,
        }
    }

    /// Whether the adapter must be uploaded.
    pub(crate) fn loads(self) -> bool {
        !matches!(self, Placement::Resident(_))
    }
}

/// A waiting request taking a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Admission {
    /// Its index in the waiting queue.
    pub waiting: usize,
    pub slot: usize,
    /// The slot whose first `reused` cache positions are copied into
    /// `slot` first; None when none are, or `slot` holds them already.
    pub copy_from: Option<usize>,
    /// Prompt tokens whose keys and values are reused, not computed.
    pub reused: usize,
    /// Its adapter's entry; None for the base model.
    pub entry: Option<Placement>,
}

/// A chunk of a prompt in a step: tokens `start..end` of the prompt of
/// the request in `slot`, padded to `bucket` (the slot holds the prompt
/// up to at least `start`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub slot: usize,
    pub start: usize,
    pub end: usize,
    pub bucket: i64,
    /// Tokens of the chunk not in the slot before (below `end - start`
    /// when a chunk that would pass the cache's end starts earlier).
    pub fresh: usize,
    /// The chunk ends the prompt: its last token samples the first token.
    pub completes: bool,
}

/// What one step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// A waiting request to move into a slot first (when no prompt is
    /// being prefilled); the chunk is then its first.
    pub admit: Option<Admission>,
    pub chunk: Option<Chunk>,
    /// Decode rows: a [`decode_buckets`] count covering every decoding
    /// slot; 0 when none decodes.
    pub rows: usize,
    /// The program of `rows` decode rows beside this chunk is not compiled
    /// yet: the chunk runs alone, then the rows decoding after it (see
    /// [`Scheduler::decode_rows`]).
    pub split: bool,
}

/// What a step gave a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sampled {
    /// A token; it goes on.
    Token(u32),
    /// Its last token, and why: it leaves its slot.
    Last(u32, FinishReason),
    /// No token: its logits were not finite. It leaves, and its slot's
    /// cache is not a prefix worth reusing.
    NotFinite,
}

/// Requests whose callers went away.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cancelled {
    pub running: usize,
    pub waiting: usize,
}

/// The state the choices are made from: the slots, what their caches
/// hold, the waiting queue and the adapter table entries.
#[derive(Debug)]
pub(crate) struct Scheduler<T> {
    limits: Limits,
    slots: Vec<Option<Running<T>>>,
    held: Vec<Held>,
    entries: Vec<Option<Entry>>,
    waiting: VecDeque<Request<T>>,
    /// Counts admissions and adapter uses, for first come first served
    /// and least recently used.
    tick: u64,
}

impl<T> Scheduler<T> {
    pub(crate) fn new(limits: Limits) -> Scheduler<T> {
        Scheduler {
            limits,
            slots: (0..limits.slots).map(|_| None).collect(),
            held: vec![Held::default(); limits.slots],
            entries: vec![None; limits.entries],
            waiting: VecDeque::new(),
            tick: 0,
        }
    }

    /// Queues `request` behind the others.
    pub(crate) fn enqueue(&mut self, request: Request<T>) {
        self.waiting.push_back(request);
    }

    /// The waiting requests, first come first.
    pub(crate) fn waiting(&self) -> &VecDeque<Request<T>> {
        &self.waiting
    }

    /// Takes the waiting request `k` out of the queue (its adapter could
    /// not be read: it fails alone).
    pub(crate) fn remove_waiting(&mut self, k: usize) -> Option<Request<T>> {
        self.waiting.remove(k)
    }

    /// The request in `slot`, if any.
    pub(crate) fn slot(&self, slot: usize) -> Option<&Running<T>> {
        self.slots.get(slot)?.as_ref()
    }

    /// Requests in slots.
    pub(crate) fn running(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Whether a request runs or waits.
    pub(crate) fn busy(&self) -> bool {
        self.running() > 0 || !self.waiting.is_empty()
    }

    /// The next step: a chunk of the oldest prompt being prefilled, else
    /// of a waiting request admitted now ([`Scheduler::admission`]), beside
    /// a decode token for every running request. `compiled` says whether
    /// the step program of (decode rows, chunk bucket) is ready.
    pub(crate) fn plan(&self, compiled: impl Fn((i64, i64)) -> bool) -> Plan {
        let rows = self.decode_rows();
        let (admit, chunk) = match self.oldest_prefilling() {
            Some((slot, prefilled, len)) => (None, Some(self.chunk(slot, prefilled, len, rows))),
            None => match self.admission() {
                Some(a) => {
                    let len = self.waiting[a.waiting].prompt.len();
                    (Some(a), Some(self.chunk(a.slot, a.reused, len, rows)))
                }
                None => (None, None),
            },
        };
        let split = chunk.is_some_and(|c| rows > 0 && !compiled((rows as i64, c.bucket)));
        Plan {
            admit,
            chunk,
            rows,
            split,
        }
    }

    /// The slot, prefilled tokens and prompt length of the request
    /// admitted first among those still prefilling.
    fn oldest_prefilling(&self) -> Option<(usize, usize, usize)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(k, r)| match r.as_ref()? {
                Running {
                    phase: Phase::Prefilling { prefilled },
                    admitted,
                    request,
                    ..
                } => Some((*admitted, k, *prefilled, request.prompt.len())),
                _ => None,
            })
            .min()
            .map(|(_, k, prefilled, len)| (k, prefilled, len))
    }

    /// The next chunk of a `len`-token prompt in `slot` that holds
    /// `prefilled` of it: a power of two up to the budget alone, up to
    /// half of it beside decode rows (the shapes of
    /// [`super::step_shapes`]).
    fn chunk(&self, slot: usize, prefilled: usize, len: usize, rows: usize) -> Chunk {
        let l = &self.limits;
        let most = match rows {
            0 => chunk_alone(l.max_num_batched_tokens),
            _ => chunk_beside_decode(l.max_num_batched_tokens),
        };
        let n = (len - prefilled).min(most);
        let bucket = prefill_bucket(n, l.max_model_len);
        // A chunk that would pass the cache's end starts earlier,
        // computing again a few positions the slot already holds.
        let start = prefilled.min(usize::try_from(l.max_model_len - bucket).unwrap_or(0));
        Chunk {
            slot,
            start,
            end: prefilled + n,
            bucket,
            fresh: n,
            completes: prefilled + n == len,
        }
    }

    /// The smallest decode row count covering every decoding slot (new
    /// requests take the lowest free slot, so running ones gather at the
    /// front); 0 when none decodes.
    pub(crate) fn decode_rows(&self) -> usize {
        let decoding = |r: &Option<Running<T>>| {
            r.as_ref()
                .is_some_and(|r| matches!(r.phase, Phase::Decoding { .. }))
        };
        let slots = self.slots.len() as i64;
        match self.slots.iter().rposition(decoding) {
            None => 0,
            Some(last) => decode_buckets(slots)
                .into_iter()
                .find(|&r| r > last as i64)
                .unwrap_or(slots) as usize,
        }
    }

    /// The first waiting request whose adapter can be placed now, into a
    /// free slot: the one holding the longest prefix of its prompt under
    /// its adapter, else the lowest free one (which then starts from the
    /// longest such prefix a running request's slot holds, copied). None
    /// when no slot is free or no waiting request can be placed.
    pub(crate) fn admission(&self) -> Option<Admission> {
        let free = self.slots.iter().position(Option::is_none)?;
        let (waiting, entry) =
            self.waiting
                .iter()
                .enumerate()
                .find_map(|(k, w)| match w.adapter {
                    None => Some((k, None)),
                    Some(id) => self.placement(id).map(|p| (k, Some(p))),
                })?;
        let w = &self.waiting[waiting];
        let (source, reused) = self.longest_prefix(w.adapter, &w.prompt);
        let slot = match source {
            Some(s) if self.slots[s].is_none() => s,
            _ => free,
        };
        Some(Admission {
            waiting,
            slot,
            copy_from: source.filter(|&s| s != slot),
            reused,
            entry,
        })
    }

    /// The table entry of `adapter`: where it is resident, else a free
    /// one, else the least recently used one no running request reads.
    /// None when every entry is read.
    pub(crate) fn placement(&self, adapter: u64) -> Option<Placement> {
        if let Some(k) = self
            .entries
            .iter()
            .position(|e| e.is_some_and(|e| e.adapter == adapter))
        {
            return Some(Placement::Resident(k + 1));
        }
        if let Some(k) = self.entries.iter().position(Option::is_none) {
            return Some(Placement::Free(k + 1));
        }
        let read: Vec<usize> = self.slots.iter().flatten().map(|r| r.entry).collect();
        self.entries
            .iter()
            .enumerate()
            .filter(|(k, _)| !read.contains(&(k + 1)))
            .filter_map(|(k, e)| e.map(|e| (k, e)))
            .min_by_key(|(_, e)| e.used)
            .map(|(k, e)| Placement::Evict {
                entry: k + 1,
                adapter: e.adapter,
            })
    }

    /// The slot whose cache holds the longest prefix of `prompt` under
    /// `adapter`, and its length, at most all but the last prompt token
    /// (whose logits must be computed). Of equal prefixes the last free
    /// slot's wins: it needs no copy. (None, 0) without prefix caching or
    /// a match.
    pub(crate) fn longest_prefix(
        &self,
        adapter: Option<u64>,
        prompt: &[u32],
    ) -> (Option<usize>, usize) {
        if !self.limits.prefix_caching {
            return (None, 0);
        }
        let most = prompt.len().saturating_sub(1);
        let mut best = (None, 0);
        for (k, held) in self.held.iter().enumerate() {
            if held.adapter != adapter {
                continue;
            }
            let n = held
                .tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
                .min(most);
            if n > best.1 || (n == best.1 && n > 0 && self.slots[k].is_none()) {
                best = (Some(k), n);
            }
        }
        best
    }

    /// Records admission `a` (from [`Scheduler::plan`] of this state),
    /// once its programs (the adapter's upload, the prefix's copy) ran.
    /// False when `a` is not of this state: a bug.
    pub(crate) fn admit(&mut self, a: &Admission) -> bool {
        let Some(request) = self.waiting.get(a.waiting) else {
            return false;
        };
        let entry_fits = match (request.adapter, a.entry) {
            (None, None) => true,
            (Some(_), Some(p)) => (1..=self.entries.len()).contains(&p.entry()),
            _ => false,
        };
        let slot_free = self.slots.get(a.slot).is_some_and(Option::is_none);
        if !entry_fits || !slot_free || a.reused >= request.prompt.len() {
            return false;
        }
        if let (Some(adapter), Some(p)) = (request.adapter, a.entry) {
            self.tick += 1;
            self.entries[p.entry() - 1] = Some(Entry {
                adapter,
                used: self.tick,
            });
        }
        let Some(request) = self.waiting.remove(a.waiting) else {
            return false;
        };
        self.held[a.slot] = Held {
            adapter: request.adapter,
            tokens: request.prompt[..a.reused].to_vec(),
        };
        self.tick += 1;
        self.slots[a.slot] = Some(Running {
            request,
            entry: a.entry.map_or(0, Placement::entry),
            admitted: self.tick,
            phase: Phase::Prefilling {
                prefilled: a.reused,
            },
            generated: 0,
        });
        true
    }

    /// Records what a step of `rows` decode rows and `chunk` sampled:
    /// `next[k]` for decode row `k`, then `next[rows]` for the chunk.
    /// `tell` hears each request that got something, before a request
    /// that ends leaves its slot.
    pub(crate) fn record(
        &mut self,
        rows: usize,
        chunk: Option<&Chunk>,
        next: &[i32],
        vocab: i64,
        mut tell: impl FnMut(&T, Sampled),
    ) {
        for (slot, &next) in next.iter().enumerate().take(rows.min(self.slots.len())) {
            let Some(r) = self.slots[slot].as_mut() else {
                continue;
            };
            let Phase::Decoding { position, last } = r.phase else {
                continue;
            };
            let sampled = r.take(next, vocab, position + 1);
            if sampled != Sampled::NotFinite {
                self.held[slot].tokens.push(last);
            }
            self.settle(slot, sampled, &mut tell);
        }
        let Some(c) = chunk else {
            return;
        };
        let Some(r) = self.slots.get_mut(c.slot).and_then(Option::as_mut) else {
            return;
        };
        let Phase::Prefilling { prefilled } = r.phase else {
            return;
        };
        let prompt = &r.request.prompt;
        self.held[c.slot]
            .tokens
            .extend_from_slice(&prompt[prefilled..c.end]);
        r.phase = Phase::Prefilling { prefilled: c.end };
        if c.end < prompt.len() {
            return;
        }
        let Some(&next) = next.get(rows) else {
            return;
        };
        let sampled = r.take(next, vocab, c.end as i64);
        self.settle(c.slot, sampled, &mut tell);
    }

    /// Tells `slot`'s request what it got, and frees the slot if it ends.
    fn settle(&mut self, slot: usize, sampled: Sampled, tell: &mut impl FnMut(&T, Sampled)) {
        if let Some(r) = &self.slots[slot] {
            tell(&r.request.payload, sampled);
        }
        match sampled {
            Sampled::Token(_) => {}
            Sampled::Last(..) => self.slots[slot] = None,
            Sampled::NotFinite => {
                self.slots[slot] = None;
                self.held[slot] = Held::default();
            }
        }
    }

    /// Frees the slots, and empties the queue, of the requests whose
    /// caller is `gone`. A freed slot's cache keeps what it held.
    pub(crate) fn cancel(&mut self, gone: impl Fn(&T) -> bool) -> Cancelled {
        let mut running = 0;
        for slot in &mut self.slots {
            if slot.as_ref().is_some_and(|r| gone(&r.request.payload)) {
                *slot = None;
                running += 1;
            }
        }
        let before = self.waiting.len();
        self.waiting.retain(|w| !gone(&w.payload));
        Cancelled {
            running,
            waiting: before - self.waiting.len(),
        }
    }

    /// Takes every request out: the running ones, then the waiting ones.
    pub(crate) fn drain(&mut self) -> (Vec<T>, Vec<T>) {
        let running = self.slots.iter_mut().filter_map(Option::take);
        let running = running.map(|r| r.request.payload).collect();
        let waiting = self.waiting.drain(..).map(|w| w.payload).collect();
        (running, waiting)
    }

    /// The first slot whose cache no request and no held prefix uses at
    /// or after position `start`: a warm-up chunk written there changes
    /// nothing a request can read.
    pub(crate) fn untouched_from(&self, start: i64) -> Option<usize> {
        (0..self.slots.len()).find(|&k| {
            let used = match self.slots[k].as_ref().map(|r| r.phase) {
                None => 0,
                Some(Phase::Prefilling { prefilled }) => prefilled,
                Some(Phase::Decoding { position, .. }) => position as usize,
            };
            used.max(self.held[k].tokens.len()) as i64 <= start
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VOCAB: i64 = 1000;
    /// The token every step samples in these tests.
    const T: i32 = 7;

    /// A cache of 64 positions, a budget of 64 tokens, prefix caching.
    fn limits(slots: usize, entries: usize) -> Limits {
        Limits {
            slots,
            entries,
            max_model_len: 64,
            max_num_batched_tokens: 64,
            prefix_caching: true,
        }
    }

    /// Request `label`: up to 100 tokens, no stop token.
    fn request(label: u32, prompt: &[u32], adapter: Option<u64>) -> Request<u32> {
        Request {
            prompt: prompt.to_vec(),
            adapter,
            max_tokens: 100,
            stop_ids: Vec::new(),
            payload: label,
        }
    }

    /// [`request`] that ends after its first token.
    fn one_token(label: u32, prompt: &[u32], adapter: Option<u64>) -> Request<u32> {
        Request {
            max_tokens: 1,
            ..request(label, prompt, adapter)
        }
    }

    /// `n` tokens from `from`.
    fn tokens(n: u32, from: u32) -> Vec<u32> {
        (from..from + n).collect()
    }

    /// A step as the batcher runs it: plans (with the programs of decode
    /// rows beside a chunk `mixed` compiled or not), admits, and records
    /// `next` for every output. Returns the plan and what each request
    /// was told, by label.
    fn step_with(s: &mut Scheduler<u32>, mixed: bool, next: i32) -> (Plan, Vec<(u32, Sampled)>) {
        let plan = s.plan(|(rows, chunk)| mixed || rows == 0 || chunk == 0);
        if let Some(a) = &plan.admit {
            assert!(s.admit(a), "{a:?}");
        }
        let mut told = Vec::new();
        let mut tell = |label: &u32, sampled| told.push((*label, sampled));
        match plan.chunk {
            Some(c) if plan.split => {
                s.record(0, Some(&c), &[next], VOCAB, &mut tell);
                let rows = s.decode_rows();
                s.record(rows, None, &vec![next; rows], VOCAB, &mut tell);
            }
            chunk => {
                let outs = plan.rows + usize::from(chunk.is_some());
                s.record(
                    plan.rows,
                    chunk.as_ref(),
                    &vec![next; outs],
                    VOCAB,
                    &mut tell,
                );
            }
        }
        (plan, told)
    }

    fn step(s: &mut Scheduler<u32>) -> (Plan, Vec<(u32, Sampled)>) {
        step_with(s, true, T)
    }

    fn phase(s: &Scheduler<u32>, slot: usize) -> Option<Phase> {
        s.slot(slot).map(|r| r.phase)
    }

    fn label(s: &Scheduler<u32>, slot: usize) -> Option<u32> {
        s.slot(slot).map(|r| r.request.payload)
    }

    /// A scheduler whose slot 0 holds `prompt` under `adapter`, its
    /// request gone after its first token.
    fn holding(limits: Limits, prompt: &[u32], adapter: Option<u64>) -> Scheduler<u32> {
        let mut s = Scheduler::new(limits);
        s.enqueue(one_token(0, prompt, adapter));
        let (_, told) = step(&mut s);
        assert_eq!(told, [(0, Sampled::Last(7, FinishReason::Length))]);
        assert_eq!(s.running(), 0);
        s
    }

    #[test]
    fn a_long_prompt_is_prefilled_in_order_in_chunks_within_the_budget() {
        let budget = 48;
        let mut s = Scheduler::new(Limits {
            max_model_len: 256,
            max_num_batched_tokens: budget,
            ..limits(2, 1)
        });
        let prompt = tokens(100, 1);
        s.enqueue(request(0, &prompt, None));
        let mut chunks = Vec::new();
        let told = loop {
            let (plan, told) = step(&mut s);
            assert_eq!(plan.admit.is_some(), chunks.is_empty(), "{plan:?}");
            assert_eq!(plan.rows, 0);
            let c = plan.chunk.expect("a chunk every step");
            assert!(c.bucket as usize <= budget && c.end - c.start <= c.bucket as usize);
            chunks.push((c.start, c.end, c.bucket));
            if !told.is_empty() {
                break told;
            }
            assert_eq!(phase(&s, 0), Some(Phase::Prefilling { prefilled: c.end }));
        };
        // The largest power of two within the budget, then the rest.
        assert_eq!(
            chunks,
            [(0, 32, 32), (32, 64, 32), (64, 96, 32), (96, 100, 16)]
        );
        assert_eq!(told, [(0, Sampled::Token(7))]);
        let decoding = Phase::Decoding {
            position: 100,
            last: 7,
        };
        assert_eq!(phase(&s, 0), Some(decoding));
        assert_eq!(s.plan(|_| true).rows, 2);
    }

    #[test]
    fn a_chunk_that_would_pass_the_cache_end_starts_earlier() {
        let mut s = Scheduler::new(Limits {
            max_model_len: 40,
            max_num_batched_tokens: 32,
            ..limits(1, 1)
        });
        s.enqueue(request(0, &tokens(39, 1), None));
        let (first, _) = step(&mut s);
        let (second, told) = step(&mut s);
        let c = first.chunk.unwrap();
        assert_eq!((c.start, c.end, c.bucket, c.fresh), (0, 32, 32, 32));
        // 7 tokens in a 16-token bucket would pass position 40: it starts
        // at 24, computing 8 positions again.
        let c = second.chunk.unwrap();
        assert_eq!((c.start, c.end, c.bucket, c.fresh), (24, 39, 16, 7));
        assert!(c.completes);
        assert_eq!(told, [(0, Sampled::Token(7))]);
    }

    #[test]
    fn beside_decode_rows_a_chunk_is_at_most_half_the_budget() {
        let mut s = Scheduler::new(limits(8, 1));
        s.enqueue(request(0, &tokens(5, 1), None));
        step(&mut s);
        s.enqueue(request(1, &tokens(60, 100), None));
        let plan = s.plan(|_| true);
        assert_eq!(plan.rows, 2);
        let c = plan.chunk.unwrap();
        assert_eq!((c.slot, c.start, c.end, c.bucket), (1, 0, 32, 32));
        assert_eq!(c.bucket as usize, chunk_beside_decode(64));
        assert!(!plan.split);
        // Alone, the same prompt takes the whole budget.
        let mut alone = Scheduler::new(limits(8, 1));
        alone.enqueue(request(1, &tokens(60, 100), None));
        let c = alone.plan(|_| true).chunk.unwrap();
        assert_eq!((c.end, c.bucket), (60, 64));
        assert_eq!(c.bucket as usize, chunk_alone(64));
    }

    #[test]
    fn decode_rows_are_rounded_up_to_a_decode_bucket() {
        let mut s = Scheduler::new(limits(8, 1));
        assert_eq!(s.decode_rows(), 0);
        let mut rows = Vec::new();
        for k in 0..6 {
            s.enqueue(request(k, &tokens(3, 1 + k), None));
            step(&mut s);
            rows.push(s.decode_rows());
        }
        // Slots 0.. decode: at least 2 rows, then 4, then all 8.
        assert_eq!(rows, [2, 2, 4, 4, 8, 8]);
        // A gap counts up to the last decoding slot.
        s.cancel(|&k| k < 5);
        assert_eq!(s.decode_rows(), 8);
        s.cancel(|_| true);
        assert_eq!(s.decode_rows(), 0);
    }

    #[test]
    fn without_the_mixed_program_the_chunk_runs_alone_then_the_rows() {
        let mut s = Scheduler::new(limits(4, 1));
        s.enqueue(request(0, &tokens(5, 1), None));
        step(&mut s);
        s.enqueue(request(1, &tokens(5, 20), None));
        let plan = s.plan(|(rows, chunk)| rows == 0 || chunk == 0);
        assert!(plan.split && plan.rows == 2);
        assert!(!s.plan(|_| true).split);
        // Request 1's prompt is in after its chunk: it decodes in the same
        // step, beside request 0.
        let (_, told) = step_with(&mut s, false, T);
        let t = Sampled::Token(7);
        assert_eq!(told, [(1, t), (0, t), (1, t)]);
    }

    #[test]
    fn requests_take_the_lowest_free_slot_first_come_first_served() {
        let mut s = Scheduler::new(limits(3, 1));
        for k in 0..3 {
            s.enqueue(request(k, &tokens(4, 10 * k + 1), None));
        }
        for k in 0..3 {
            let (plan, _) = step(&mut s);
            let a = plan.admit.unwrap();
            assert_eq!((a.waiting, a.slot), (0, k as usize));
            assert_eq!(label(&s, k as usize), Some(k));
        }
        s.cancel(|&k| k != 1);
        s.enqueue(request(3, &tokens(4, 90), None));
        assert_eq!(s.plan(|_| true).admit.unwrap().slot, 0);
        // No free slot: nothing is admitted.
        s.enqueue(request(4, &tokens(4, 80), None));
        step(&mut s);
        step(&mut s);
        assert_eq!(s.plan(|_| true).admit, None);
    }

    #[test]
    fn a_prefix_in_a_free_slot_is_reused_in_place() {
        let prompt = tokens(10, 1);
        let mut s = holding(limits(4, 1), &prompt, None);
        let mut shared = prompt[..6].to_vec();
        shared.extend([50, 51]);
        s.enqueue(request(1, &shared, None));
        let plan = s.plan(|_| true);
        let a = plan.admit.unwrap();
        assert_eq!((a.slot, a.copy_from, a.reused), (0, None, 6));
        let c = plan.chunk.unwrap();
        assert_eq!((c.slot, c.start, c.end, c.fresh), (0, 6, 8, 2));
    }

    #[test]
    fn a_prefix_in_a_running_slot_is_copied_to_the_lowest_free_slot() {
        let prompt = tokens(10, 1);
        let mut s = Scheduler::new(limits(4, 1));
        s.enqueue(request(0, &prompt, None));
        step(&mut s);
        // Request 0 decodes: its slot holds its prompt and then its tokens.
        step(&mut s);
        let mut longer = prompt.clone();
        longer.extend([7, 99]);
        s.enqueue(request(1, &longer, None));
        let a = s.plan(|_| true).admit.unwrap();
        assert_eq!((a.slot, a.copy_from, a.reused), (1, Some(0), 11));
    }

    #[test]
    fn a_tie_goes_to_a_free_slot_which_needs_no_copy() {
        let prompt = tokens(10, 1);
        let mut s = Scheduler::new(limits(4, 1));
        s.enqueue(request(0, &prompt, None));
        step(&mut s);
        // Request 1 copies request 0's prefix and ends: slot 1 holds it.
        s.enqueue(one_token(1, &prompt, None));
        let (plan, _) = step(&mut s);
        let a = plan.admit.unwrap();
        assert_eq!((a.slot, a.copy_from, a.reused), (1, Some(0), 9));
        assert_eq!(label(&s, 1), None);
        s.enqueue(request(2, &prompt[..8], None));
        let a = s.plan(|_| true).admit.unwrap();
        assert_eq!((a.slot, a.copy_from, a.reused), (1, None, 7));
    }

    #[test]
    fn a_prefix_is_never_reused_across_adapters() {
        let prompt = tokens(10, 1);
        for (held, asked, reused) in [
            (Some(1), None, 0),
            (Some(1), Some(2), 0),
            (None, Some(1), 0),
            (Some(1), Some(1), 9),
            (None, None, 9),
        ] {
            let mut s = holding(limits(4, 2), &prompt, held);
            s.enqueue(request(1, &prompt, asked));
            let a = s.plan(|_| true).admit.unwrap();
            assert_eq!(a.reused, reused, "{held:?} {asked:?}");
            assert_eq!(a.copy_from, None);
        }
    }

    #[test]
    fn the_last_prompt_token_is_always_computed() {
        let prompt = tokens(10, 1);
        let mut s = holding(limits(4, 1), &prompt, None);
        s.enqueue(request(1, &prompt, None));
        let (plan, told) = step(&mut s);
        assert_eq!(plan.admit.unwrap().reused, 9);
        let c = plan.chunk.unwrap();
        assert_eq!((c.start, c.end, c.fresh, c.completes), (9, 10, 1, true));
        assert_eq!(told, [(1, Sampled::Token(7))]);
        // A one-token prompt reuses nothing.
        assert_eq!(s.longest_prefix(None, &prompt[..1]), (None, 0));
    }

    #[test]
    fn without_prefix_caching_nothing_is_reused() {
        let prompt = tokens(10, 1);
        let off = Limits {
            prefix_caching: false,
            ..limits(4, 1)
        };
        let mut s = holding(off, &prompt, None);
        s.enqueue(request(1, &prompt, None));
        let a = s.plan(|_| true).admit.unwrap();
        assert_eq!((a.slot, a.copy_from, a.reused), (0, None, 0));
    }

    #[test]
    fn cancelled_requests_free_their_slots_and_leave_the_queue() {
        let mut s = Scheduler::new(limits(1, 1));
        let prompt = tokens(10, 1);
        s.enqueue(request(0, &prompt, None));
        step(&mut s);
        s.enqueue(request(1, &prompt, None));
        s.enqueue(request(2, &prompt, None));
        let gone = s.cancel(|&k| k != 1);
        let counts = Cancelled {
            running: 1,
            waiting: 1,
        };
        assert_eq!(gone, counts);
        assert_eq!(s.running(), 0);
        let waiting: Vec<u32> = s.waiting().iter().map(|w| w.payload).collect();
        assert_eq!(waiting, [1]);
        // The freed slot keeps what its cache holds.
        let (plan, _) = step(&mut s);
        let a = plan.admit.unwrap();
        assert_eq!((a.slot, a.reused), (0, 9));
        assert_eq!(label(&s, 0), Some(1));
        assert_eq!(s.cancel(|_| false), Cancelled::default());
        assert!(s.busy());
        assert_eq!(s.drain(), (vec![1], vec![]));
        assert!(!s.busy());
    }

    #[test]
    fn a_request_beyond_max_queue_is_refused() {
        assert!(queue_room(0, 1).is_ok());
        assert!(queue_room(3, 4).is_ok());
        assert!(matches!(queue_room(4, 4), Err(SubmitError::QueueFull(4))));
        assert!(matches!(queue_room(0, 0), Err(SubmitError::QueueFull(0))));
    }

    #[test]
    fn a_resident_adapter_is_reused_and_a_new_one_takes_a_free_entry() {
        let mut s = Scheduler::new(limits(4, 2));
        s.enqueue(request(0, &tokens(4, 1), Some(7)));
        let (plan, _) = step(&mut s);
        assert_eq!(plan.admit.unwrap().entry, Some(Placement::Free(1)));
        assert_eq!(s.slot(0).map(|r| r.entry), Some(1));
        assert_eq!(s.placement(7), Some(Placement::Resident(1)));
        assert_eq!(s.placement(8), Some(Placement::Free(2)));
        s.enqueue(request(1, &tokens(4, 20), None));
        let (plan, _) = step(&mut s);
        assert_eq!(plan.admit.unwrap().entry, None);
        assert_eq!(s.slot(1).map(|r| r.entry), Some(0));
    }

    #[test]
    fn the_least_recently_used_entry_no_request_reads_is_evicted() {
        let mut s = Scheduler::new(limits(4, 2));
        s.enqueue(one_token(0, &tokens(4, 1), Some(1)));
        step(&mut s);
        s.enqueue(one_token(1, &tokens(4, 1), Some(2)));
        step(&mut s);
        // Adapter 1 used again: adapter 2 is the least recently used.
        s.enqueue(one_token(2, &tokens(4, 1), Some(1)));
        let (plan, _) = step(&mut s);
        assert_eq!(plan.admit.unwrap().entry, Some(Placement::Resident(1)));
        let evict = Placement::Evict {
            entry: 2,
            adapter: 2,
        };
        assert_eq!(s.placement(3), Some(evict));
        // A running request on adapter 2 keeps it: adapter 1 goes.
        s.enqueue(request(3, &tokens(4, 1), Some(2)));
        step(&mut s);
        let evict = Placement::Evict {
            entry: 1,
            adapter: 1,
        };
        assert_eq!(s.placement(3), Some(evict));
        s.enqueue(request(4, &tokens(4, 1), Some(3)));
        let (plan, _) = step(&mut s);
        assert_eq!(plan.admit.unwrap().entry, Some(evict));
        assert_eq!(s.placement(1), None);
        assert_eq!(s.placement(3), Some(Placement::Resident(1)));
    }

    #[test]
    fn a_request_whose_adapter_cannot_be_placed_waits() {
        let mut s = Scheduler::new(limits(4, 1));
        s.enqueue(request(0, &tokens(4, 1), Some(1)));
        step(&mut s);
        s.enqueue(request(1, &tokens(4, 1), Some(2)));
        s.enqueue(request(2, &tokens(4, 1), None));
        assert_eq!(s.placement(2), None);
        // The request behind it, on the base model, goes first.
        let (plan, _) = step(&mut s);
        let a = plan.admit.unwrap();
        assert_eq!((a.waiting, a.slot), (1, 1));
        assert_eq!(s.plan(|_| true).admit, None);
        let waiting: Vec<u32> = s.waiting().iter().map(|w| w.payload).collect();
        assert_eq!(waiting, [1]);
        // Once adapter 1's request is gone, adapter 2 replaces it.
        s.cancel(|&k| k == 0);
        let a = s.plan(|_| true).admit.unwrap();
        let evict = Placement::Evict {
            entry: 1,
            adapter: 1,
        };
        assert_eq!((a.waiting, a.entry), (0, Some(evict)));
    }

    #[test]
    fn requests_end_at_a_stop_token_at_max_tokens_or_without_a_token() {
        let prompt = tokens(6, 1);
        let mut s = Scheduler::new(limits(4, 1));
        s.enqueue(Request {
            stop_ids: vec![7],
            ..request(0, &prompt, None)
        });
        let (_, told) = step(&mut s);
        assert_eq!(told, [(0, Sampled::Last(7, FinishReason::Stop))]);
        s.enqueue(Request {
            max_tokens: 3,
            ..request(1, &tokens(3, 40), None)
        });
        let told: Vec<_> = (0..3).flat_map(|_| step(&mut s).1).collect();
        let t = Sampled::Token(7);
        assert_eq!(
            told,
            [(1, t), (1, t), (1, Sampled::Last(7, FinishReason::Length))]
        );
        // A decode row whose logits are not finite leaves, and its slot's
        // cache is not reused; one past the vocabulary is the same.
        for bad in [-1, VOCAB as i32] {
            s.enqueue(request(2, &prompt, None));
            step(&mut s);
            let (_, told) = step_with(&mut s, true, bad);
            assert_eq!(told, [(2, Sampled::NotFinite)]);
            assert_eq!(s.running(), 0);
            s.enqueue(request(3, &prompt, None));
            let a = s.plan(|_| true).admit.unwrap();
            assert_eq!(a.reused, 0, "{bad}");
            s.remove_waiting(0);
        }
    }

    #[test]
    fn decoding_advances_the_position_and_what_the_slot_holds() {
        let prompt = tokens(5, 1);
        let mut s = Scheduler::new(limits(2, 1));
        s.enqueue(request(0, &prompt, None));
        for position in 5..8 {
            let (_, told) = step(&mut s);
            assert_eq!(told, [(0, Sampled::Token(7))]);
            let decoding = Phase::Decoding { position, last: 7 };
            assert_eq!(phase(&s, 0), Some(decoding));
        }
        // The slot holds the prompt and the two tokens fed back.
        let mut held = prompt.clone();
        held.extend([7, 7, 99]);
        assert_eq!(s.longest_prefix(None, &held), (Some(0), 7));
        // A warm-up chunk goes where nothing is used from its start.
        assert_eq!(s.untouched_from(7), Some(0));
        assert_eq!(s.untouched_from(6), Some(1));
        let mut full = Scheduler::<u32>::new(limits(1, 1));
        full.enqueue(request(0, &prompt, None));
        step(&mut full);
        assert_eq!(full.untouched_from(4), None);
    }

    #[test]
    fn an_admission_of_another_state_is_refused() {
        let mut s = Scheduler::new(limits(2, 1));
        s.enqueue(request(0, &tokens(4, 1), Some(1)));
        let a = s.plan(|_| true).admit.unwrap();
        let stale = [
            Admission { waiting: 1, ..a },
            Admission { slot: 2, ..a },
            Admission { entry: None, ..a },
            Admission {
                entry: Some(Placement::Free(2)),
                ..a
            },
            Admission { reused: 4, ..a },
        ];
        for bad in stale {
            assert!(!s.admit(&bad), "{bad:?}");
        }
        assert!(s.admit(&a));
        assert!(!s.admit(&a));
    }
}
