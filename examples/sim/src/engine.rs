//! One simulated engine: admission, cache, latency and the events it publishes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_prompt::{LlmRequest, Preprocessor, PromptError};
use kvroute_protocol::hash::{local_block_hashes, prefix_hashes};
use kvroute_protocol::{HashSeed, PrefixHash};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::cache::PrefixCache;
use crate::gpu::{Gpu, GpuConfig};
use crate::publish::CacheChange;

/// Settings of one engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Position in the fleet (shown in the `x-sim-engine` response header).
    pub index: usize,
    /// Served model name.
    pub model: String,
    /// KV cache capacity in blocks.
    pub capacity_blocks: usize,
    /// Requests running at once; more wait in a queue.
    pub max_running: usize,
    /// Fixed cost of every request, µs.
    pub base_latency_us: u64,
    /// Prefill cost per prompt token that was not cached, µs.
    pub prefill_us_per_token: u64,
    /// Decode cost per output token, µs.
    pub decode_us_per_token: u64,
    /// Output tokens when the request does not set `max_tokens`.
    pub default_output_tokens: u32,
    /// Longest prompt accepted, in tokens (vLLM's `max_model_len`).
    pub max_model_len: usize,
    /// How long a request takes to reach the scheduler, uncounted by any gauge until then:
    /// vLLM's API server renders and tokenizes it first, hundreds of ms on a busy CPU machine.
    pub frontend_delay: Duration,
    /// How late `/metrics` answers, with the numbers of when it was asked: a busy API server.
    pub metrics_delay: Duration,
    /// Running requests share one GPU, a step at a time ([`crate::gpu`]); `None`: each
    /// request pays its own prefill and decode time, whatever its neighbours do.
    pub batching: Option<GpuConfig>,
}

/// Counters in vLLM's terms.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Requests holding a slot.
    pub running: AtomicU64,
    /// Requests waiting for a slot.
    pub waiting: AtomicU64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: AtomicU64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: AtomicU64,
    /// Requests finished.
    pub requests: AtomicU64,
    /// KV blocks used by running requests (cached but idle blocks are reusable, not used).
    pub active_blocks: AtomicU64,
    /// Cached blocks evicted to make room (`kvroute_sim:evicted_blocks_total`).
    pub evicted_blocks: AtomicU64,
    /// Set to make `/health` and completions fail, as an engine on its way down would.
    pub unhealthy: std::sync::atomic::AtomicBool,
    /// KV-event messages to leave out of the live stream (still replayable): a test hook.
    pub drop_events: std::sync::Arc<AtomicU64>,
    /// Completions still to fail with 503 before serving again (one bad request, not a dead engine).
    pub fail_next: AtomicU64,
    /// Completions answered with an error (503 for `fail_next`, 500 while down).
    pub failed: AtomicU64,
}

/// What prefill found and cost.
#[derive(Debug, Clone, Copy)]
pub struct Prefilled {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// How long it waited for a free slot before its prefill started.
    pub slot_wait: Duration,
}

/// A running request: holds its slot and its KV blocks until dropped.
pub struct Running {
    /// Prefill results.
    pub prefilled: Prefilled,
    prefixes: Vec<PrefixHash>,
    blocks: usize,
    _slot: OwnedSemaphorePermit,
    engine: Arc<Engine>,
}

impl Drop for Running {
    fn drop(&mut self) {
        {
            let mut cache = self.engine.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.release(&self.prefixes, self.blocks);
            self.engine.count_used(&cache);
        }
        self.engine.freed.notify_waiters();
        self.engine.stats.running.fetch_sub(1, Ordering::Relaxed);
        self.engine.stats.requests.fetch_add(1, Ordering::Relaxed);
    }
}

/// Per full block of a prompt: (tokens hash, prefix hash).
type Blocks = Vec<(u64, PrefixHash)>;

/// A simulated engine.
pub struct Engine {
    /// Settings.
    pub config: EngineConfig,
    /// Counters.
    pub stats: EngineStats,
    preprocessor: Arc<Preprocessor>,
    cache: Mutex<PrefixCache>,
    slots: Arc<Semaphore>,
    /// The turn to be admitted: like vLLM's scheduler, the oldest waiting request starts only
    /// when its new blocks fit beside the running requests', and none behind it starts first.
    /// While it waits, requests admitted before it may evict the idle prefix its router
    /// counted on.
    admission: tokio::sync::Mutex<()>,
    /// Wakes the request whose turn it is when a running request frees blocks.
    freed: Notify,
    events: Option<mpsc::UnboundedSender<Vec<CacheChange>>>,
    hash_salt: u64,
    gpu: Option<Gpu>,
}

/// A running request's output tokens still to come.
pub enum Decode {
    /// One every `step`, whatever else runs.
    Timed {
        /// A token's time.
        step: Duration,
    },
    /// One at the end of each of the shared GPU's steps.
    Batched(mpsc::UnboundedReceiver<()>),
}

impl Decode {
    /// Wait for the next token.
    pub async fn next(&mut self) {
        match self {
            Decode::Timed { step } => tokio::time::sleep(*step).await,
            Decode::Batched(tokens) => {
                let _ = tokens.recv().await;
            }
        }
    }
}

impl Engine {
    /// An engine; cache changes go to `events` when given (a publisher drains it).
    pub fn new(
        config: EngineConfig,
        preprocessor: Arc<Preprocessor>,
        events: Option<mpsc::UnboundedSender<Vec<CacheChange>>>,
    ) -> Self {
        Engine {
            cache: Mutex::new(PrefixCache::new(config.capacity_blocks)),
            slots: Arc::new(Semaphore::new(config.max_running.max(1))),
            admission: tokio::sync::Mutex::new(()),
            freed: Notify::new(),
            stats: EngineStats::default(),
            // Engines name blocks with their own hash (vLLM: seeded sha256); a per-engine salt
            // keeps the index honest: it must map engine hashes, not assume they are ours.
            hash_salt: 0x5eed_0000 + config.index as u64,
            gpu: config.batching.map(Gpu::start),
            config,
            preprocessor,
            events,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.preprocessor.block_size()
    }

    /// Fraction of the KV cache used by running requests, as vLLM's `kv_cache_usage_perc`
    /// reports it (prefix-cached blocks no request uses are free, not used).
    pub fn kv_usage(&self) -> f64 {
        let used = self.stats.active_blocks.load(Ordering::Relaxed) as f64;
        (used / self.config.capacity_blocks.max(1) as f64).min(1.0)
    }

    /// The request's token ids, as this engine sees them.
    pub fn tokens(&self, req: &LlmRequest) -> Result<Vec<u32>, PromptError> {
        self.preprocessor.tokens(req)
    }

    /// The request's prompt text (`None` for token-id prompts).
    pub fn render(&self, req: &LlmRequest) -> Result<Option<String>, PromptError> {
        self.preprocessor.render(req)
    }

    /// The request's tokens and, per full block, (tokens hash, prefix hash).
    fn blocks(&self, req: &LlmRequest) -> Result<(Vec<u32>, Blocks), PromptError> {
        let tokens = self.preprocessor.tokens(req)?;
        let seed = HashSeed::for_request(req.lora.as_deref(), req.cache_salt.as_deref());
        let locals = local_block_hashes(&tokens, self.block_size(), seed);
        let prefixes = prefix_hashes(&locals);
        let blocks = locals.iter().map(|l| l.0).zip(prefixes).collect();
        Ok((tokens, blocks))
    }

    /// Leading blocks of the request this engine holds now (the oracle's answer).
    pub fn cached_blocks(&self, req: &LlmRequest) -> Result<(usize, usize), PromptError> {
        let (_, blocks) = self.blocks(req)?;
        let prefixes: Vec<PrefixHash> = blocks.iter().map(|b| b.1).collect();
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        Ok((cache.peek(&prefixes), prefixes.len()))
    }

    fn engine_hash(&self, p: PrefixHash) -> u64 {
        xxh3_64_with_seed(&p.0.to_le_bytes(), self.hash_salt)
    }

    /// Queue for a slot and for room in the KV cache, then prefill: look up the cache, store
    /// the prompt's blocks (publishing the changes), pay for the uncached tokens. `None`: the
    /// prompt exceeds `max_model_len`.
    pub async fn prefill(
        self: &Arc<Self>,
        req: &LlmRequest,
    ) -> Result<Option<Running>, PromptError> {
        let (tokens, blocks) = self.blocks(req)?;
        let prompt_tokens = tokens.len();
        if prompt_tokens > self.config.max_model_len {
            return Ok(None);
        }
        let prefixes: Vec<PrefixHash> = blocks.iter().map(|b| b.1).collect();
        let total = prompt_tokens.div_ceil(self.block_size().max(1));
        // vLLM computes at least the prompt's last token, so a prompt of whole blocks found
        // all cached uses one block less (`max_cache_hit_length = num_tokens - 1`).
        let usable = prompt_tokens.saturating_sub(1) / self.block_size().max(1);
        if !self.config.frontend_delay.is_zero() {
            tokio::time::sleep(self.config.frontend_delay).await;
        }
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        let arrived = std::time::Instant::now();
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("engine semaphore is never closed");
        let hit_blocks = {
            let _turn = self.admission.lock().await;
            loop {
                let freed = self.freed.notified();
                tokio::pin!(freed);
                freed.as_mut().enable();
                if let Some(hit) = self.admit(&blocks, &prefixes, &tokens, total, usable, req) {
                    break hit;
                }
                freed.await;
            }
        };
        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        self.stats.running.fetch_add(1, Ordering::Relaxed);
        let slot_wait = arrived.elapsed();
        let running = Running {
            prefilled: Prefilled {
                prompt_tokens,
                cached_tokens: hit_blocks * self.block_size(),
                slot_wait,
            },
            prefixes,
            blocks: total,
            _slot: slot,
            engine: self.clone(),
        };
        self.stats
            .prefix_queries
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.stats
            .prefix_hits
            .fetch_add(running.prefilled.cached_tokens as u64, Ordering::Relaxed);
        let uncached = prompt_tokens - running.prefilled.cached_tokens;
        let per_token = match &self.gpu {
            Some(_) => 0,
            None => self.config.prefill_us_per_token,
        };
        let cost = self.config.base_latency_us + uncached as u64 * per_token;
        tokio::time::sleep(Duration::from_micros(cost)).await;
        if let Some(gpu) = &self.gpu {
            gpu.prefill(uncached).await;
        }
        Ok(Some(running))
    }

    /// Forget every cached block, as a restarted engine would (and say so to subscribers).
    pub fn restart(&self) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.clear();
        if let Some(events) = &self.events {
            let _ = events.send(vec![CacheChange::Restarted]);
        }
    }

    /// Forget every cached block without a word to subscribers: what a router sees when the
    /// engine's removals are lost on the way (the test hook behind `stale_index`).
    pub fn evict_silently(&self) {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Start a request in the cache if its blocks fit now, publishing what changed: the blocks
    /// evicted for it and its new blocks (vLLM publishes both in the step that schedules it).
    /// The leading blocks it found cached, or `None` when it must wait.
    fn admit(
        &self,
        blocks: &[(u64, PrefixHash)],
        prefixes: &[PrefixHash],
        tokens: &[u32],
        total: usize,
        max_hit: usize,
        req: &LlmRequest,
    ) -> Option<usize> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let admitted = cache.admit(prefixes, total, max_hit)?;
        self.count_used(&cache);
        self.stats
            .evicted_blocks
            .fetch_add(admitted.evicted.len() as u64, Ordering::Relaxed);
        let Some(events) = &self.events else {
            return Some(admitted.hit_blocks);
        };
        let mut batch = Vec::new();
        if !admitted.evicted.is_empty() {
            let removed = admitted
                .evicted
                .iter()
                .map(|&p| self.engine_hash(p))
                .collect();
            batch.push(CacheChange::Removed(removed));
        }
        let (kept, _) = cache.kept(prefixes, total);
        if admitted.stored_from < kept {
            let parent = admitted
                .stored_from
                .checked_sub(1)
                .map(|i| self.engine_hash(blocks[i].1));
            let stored = blocks[admitted.stored_from..kept]
                .iter()
                .map(|&(local, prefix)| (self.engine_hash(prefix), local))
                .collect();
            let size = self.block_size();
            batch.push(CacheChange::Stored {
                parent,
                blocks: stored,
                tokens: tokens[admitted.stored_from * size..kept * size].to_vec(),
                lora: req.lora.clone(),
                salt_of_first: req.cache_salt.clone().filter(|_| admitted.stored_from == 0),
            });
        }
        // Sent under the cache lock so the publisher sees changes in cache order.
        let _ = events.send(batch);
        Some(admitted.hit_blocks)
    }

    /// Record the blocks running requests use, for the KV usage metric.
    fn count_used(&self, cache: &PrefixCache) {
        self.stats
            .active_blocks
            .store(cache.used() as u64, Ordering::Relaxed);
    }

    /// The output tokens after the first (which prefill yields): `tokens` of them.
    pub fn decode(&self, tokens: u32) -> Decode {
        match &self.gpu {
            Some(gpu) => Decode::Batched(gpu.decode(tokens)),
            None => Decode::Timed {
                step: Duration::from_micros(self.config.decode_us_per_token),
            },
        }
    }

    /// Wait until a whole answer of `tokens` output tokens is decoded.
    pub async fn decode_all(&self, tokens: u32) {
        match &self.gpu {
            Some(gpu) => {
                let mut each = gpu.decode(tokens.saturating_sub(1));
                while each.recv().await.is_some() {}
            }
            None => {
                let all = self.config.decode_us_per_token * u64::from(tokens);
                tokio::time::sleep(Duration::from_micros(all)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(capacity_blocks: usize) -> Arc<Engine> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny-llama");
        let bundle = kvroute_prompt::model_dir::load_bundle(dir.as_ref(), "m", 16).unwrap();
        let config = EngineConfig {
            index: 0,
            model: "m".into(),
            capacity_blocks,
            max_running: 4,
            base_latency_us: 0,
            prefill_us_per_token: 0,
            decode_us_per_token: 0,
            default_output_tokens: 1,
            max_model_len: 32768,
            frontend_delay: Duration::ZERO,
            metrics_delay: Duration::ZERO,
            batching: None,
        };
        let preprocessor = Preprocessor::from_bundle(&bundle).unwrap();
        Arc::new(Engine::new(config, Arc::new(preprocessor), None))
    }

    fn request(word: &str) -> LlmRequest {
        let prompt = vec![word; 100].join(" ");
        let body = serde_json::json!({"model": "m", "prompt": prompt});
        LlmRequest::parse(body.to_string().as_bytes()).unwrap()
    }

    /// Like vLLM, a request runs only when its KV blocks fit beside the running ones: with room
    /// for one prompt, the second waits for the first to finish, though slots are free.
    #[tokio::test]
    async fn a_request_waits_until_its_blocks_fit() {
        let (a, b) = (request("apple"), request("river"));
        let blocks = engine(1).tokens(&a).unwrap().len().div_ceil(16);
        let e = engine(blocks + blocks / 2);
        let first = e.prefill(&a).await.unwrap().unwrap();
        let second = e.prefill(&b);
        tokio::pin!(second);
        let waited = tokio::time::timeout(Duration::from_millis(50), &mut second).await;
        assert!(
            waited.is_err(),
            "started beside a request it does not fit with"
        );
        assert_eq!(e.stats.waiting.load(Ordering::Relaxed), 1);
        drop(first);
        let second = second.await.unwrap().unwrap();
        assert_eq!(e.stats.waiting.load(Ordering::Relaxed), 0);
        assert_eq!(e.stats.running.load(Ordering::Relaxed), 1);
        drop(second);
        assert_eq!(e.stats.active_blocks.load(Ordering::Relaxed), 0);
    }

    /// Like vLLM, only blocks no running request holds are evicted: a prompt that finished is
    /// lost to the next request that needs room, while one a running request shares is found
    /// in full and takes no room beside it.
    #[tokio::test]
    async fn idle_prefixes_are_evicted_running_ones_are_not() {
        let (a, b, c) = (request("apple"), request("river"), request("stone"));
        let tokens = engine(1).tokens(&b).unwrap().len();
        let c_blocks = engine(1).tokens(&c).unwrap().len().div_ceil(16);
        assert!(
            !tokens.is_multiple_of(16),
            "the second copy of b adds its partial block"
        );
        // Room for b, the second copy's own partial block and c: c fits only by evicting a.
        let e = engine(tokens.div_ceil(16) + 1 + c_blocks);
        drop(e.prefill(&a).await.unwrap().unwrap());
        let running = e.prefill(&b).await.unwrap().unwrap();
        let same = tokio::time::timeout(Duration::from_millis(50), e.prefill(&b))
            .await
            .expect("a prompt a running request holds waited for room")
            .unwrap()
            .unwrap();
        assert_eq!(same.prefilled.cached_tokens, (tokens - 1) / 16 * 16);
        let other = tokio::time::timeout(Duration::from_millis(50), e.prefill(&c))
            .await
            .expect("waited though the idle prefix could make room")
            .unwrap()
            .unwrap();
        assert_eq!(other.prefilled.cached_tokens, 0);
        assert_eq!(e.cached_blocks(&a).unwrap().0, 0, "the idle prefix stayed");
        assert_eq!(e.cached_blocks(&b).unwrap().0, tokens / 16);
        drop((running, same, other));
        assert_eq!(e.stats.active_blocks.load(Ordering::Relaxed), 0);
    }
}
