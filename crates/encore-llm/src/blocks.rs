//! The paged KV cache's bookkeeping: which blocks of the pool are free,
//! which each sequence holds, and which hold a prompt prefix that a later
//! request can reuse.
//!
//! A sequence's positions live in fixed-size blocks listed in its block
//! table; blocks are taken as the sequence grows and given back when it
//! ends, so memory follows what sequences use, not their maximum context.
//!
//! Prefix cache: a block filled entirely with prompt tokens is named by a
//! hash of every token up to its end (the hash of the block before it and
//! its own tokens), so two prompts share a block exactly when they agree on
//! everything up to that block's end. A block's K and V depend on nothing
//! else (the model's rows are computed independently of the batch), so a
//! request whose prompt starts with such blocks takes them instead of
//! computing them. Shared blocks are only read: a sequence writes at its
//! own positions past the shared prefix, which lie in blocks of its own.
//! A named block that no sequence holds any more stays cached until the
//! pool runs out of free blocks; the least recently released goes first.
//!
//! Block 0 is never handed out: rows that only pad a batch to its recorded
//! size write there.

use std::collections::{HashMap, VecDeque};

/// The block padding rows write to; never part of a sequence.
pub const PAD_BLOCK: u32 = 0;

/// The name of a full prompt block: FNV-1a over the name of the block
/// before it and the block's tokens.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The pool's blocks: reference counts, the free list and the prefix cache.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// The prefix-cache name of each block, if it holds a full prompt block.
    names: Vec<Option<u64>>,
    /// Blocks by prefix-cache name.
    by_name: HashMap<u64, u32>,
    /// Blocks nobody holds and nobody named.
    free: Vec<u32>,
    /// Named blocks nobody holds, least recently released first.
    cached: VecDeque<u32>,
    /// Prefix-cache hits and lookups, in blocks.
    hits: u64,
    lookups: u64,
}

impl BlockPool {
    /// A pool of `blocks` blocks of `block_size` positions (block 0 kept
    /// for padding).
    pub fn new(blocks: usize, block_size: usize) -> BlockPool {
        BlockPool {
            block_size,
            refs: vec![0; blocks],
            names: vec![None; blocks],
            by_name: HashMap::new(),
            free: (1..blocks as u32).rev().collect(),
            cached: VecDeque::new(),
            hits: 0,
            lookups: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that can be handed out now (free, or cached and unheld).
    pub fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// Blocks held by at least one sequence.
    pub fn in_use(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 0).count()
    }

    /// Prefix-cache hits and lookups so far, in blocks.
    pub fn prefix_stats(&self) -> (u64, u64) {
        (self.hits, self.lookups)
    }

    /// A fresh block for a sequence: a free one, else the least recently
    /// released cached one (forgetting its name). `None` when every block
    /// is held.
    pub fn take(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.cached.pop_front()?;
                if let Some(name) = self.names[b as usize].take() {
                    self.by_name.remove(&name);
                }
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// The blocks of `prompt`'s longest cached prefix of whole blocks,
    /// taken (held) for a new sequence, at most `limit` positions' worth.
    pub fn take_prefix(&mut self, prompt: &[u32], limit: usize) -> Vec<u32> {
        let mut taken = Vec::new();
        let mut parent = 0;
        for chunk in prompt[..limit.min(prompt.len())].chunks_exact(self.block_size) {
            self.lookups += 1;
            let name = block_hash(parent, chunk);
            let Some(&b) = self.by_name.get(&name) else {
                break;
            };
            self.hits += 1;
            if self.refs[b as usize] == 0 {
                self.cached.retain(|&c| c != b);
            }
            self.refs[b as usize] += 1;
            taken.push(b);
            parent = name;
        }
        taken
    }

    /// Names block `b`, the `index`-th of a sequence whose prompt is
    /// `prompt`, once the sequence has computed it whole: later prompts
    /// that agree on every token up to its end reuse it. A name already
    /// held by another block stays with that one.
    pub fn name(&mut self, b: u32, prompt: &[u32], index: usize) {
        let end = (index + 1) * self.block_size;
        if end > prompt.len() || self.names[b as usize].is_some() {
            return;
        }
        let mut parent = 0;
        for chunk in prompt[..end].chunks_exact(self.block_size) {
            parent = block_hash(parent, chunk);
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.by_name.entry(parent) {
            e.insert(b);
            self.names[b as usize] = Some(parent);
        }
    }

    /// Gives back a sequence's blocks: unheld blocks become free, or
    /// cached when named.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let r = &mut self.refs[b as usize];
            *r = r.saturating_sub(1);
            if *r == 0 {
                if self.names[b as usize].is_some() {
                    self.cached.push_back(b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn blocks_are_taken_and_given_back_and_block_0_never_leaves() {
        let mut pool = BlockPool::new(5, 4);
        assert_eq!(pool.available(), 4);
        let got: Vec<u32> = (0..4).filter_map(|_| pool.take()).collect();
        assert_eq!(got.len(), 4);
        assert!(!got.contains(&PAD_BLOCK));
        assert_eq!(pool.take(), None, "only four blocks to hand out");
        pool.release(&got[..2]);
        assert_eq!(pool.available(), 2);
        assert_eq!(pool.in_use(), 2);
    }

    #[test]
    fn a_shared_prefix_of_whole_blocks_is_reused_and_only_that() {
        let mut pool = BlockPool::new(16, 4);
        let a = prompt(10, 1);
        let blocks: Vec<u32> = (0..3).filter_map(|_| pool.take()).collect();
        // Blocks 0 and 1 of `a` are whole prompt blocks; block 2 is not.
        for (i, &b) in blocks.iter().enumerate() {
            pool.name(b, &a, i);
        }
        // The same first 9 tokens, then different: two blocks match.
        let mut b = a[..9].to_vec();
        b.extend([999, 998, 997]);
        let shared = pool.take_prefix(&b, b.len() - 1);
        assert_eq!(shared, blocks[..2]);
        // A prompt differing in its first block matches nothing, even
        // where its second block's tokens are equal.
        let mut c = a.clone();
        c[0] = 12345;
        assert!(pool.take_prefix(&c, c.len()).is_empty());
        // The limit keeps at least one token to compute.
        let d = a[..8].to_vec();
        assert_eq!(pool.take_prefix(&d, d.len() - 1).len(), 1);
        assert_eq!(pool.prefix_stats(), (3, 4));
    }

    #[test]
    fn cached_blocks_outlive_their_sequence_until_the_pool_needs_them() {
        let mut pool = BlockPool::new(4, 2);
        let a = prompt(4, 3);
        let held: Vec<u32> = (0..2).filter_map(|_| pool.take()).collect();
        pool.name(held[0], &a, 0);
        pool.name(held[1], &a, 1);
        pool.release(&held);
        assert_eq!(pool.in_use(), 0);
        // Still found after release.
        assert_eq!(pool.take_prefix(&a, 4), held);
        pool.release(&held);
        // Taking every block evicts the cached ones, oldest first.
        let all: Vec<u32> = (0..3).filter_map(|_| pool.take()).collect();
        assert_eq!(all.len(), 3);
        assert!(
            pool.take_prefix(&a, 4).is_empty(),
            "evicted blocks are forgotten"
        );
    }

    #[test]
    fn a_block_held_twice_is_freed_only_when_both_let_go() {
        let mut pool = BlockPool::new(4, 2);
        let a = prompt(4, 5);
        let b0 = pool.take().unwrap_or(PAD_BLOCK);
        pool.name(b0, &a, 0);
        let again = pool.take_prefix(&a, 3);
        assert_eq!(again, vec![b0]);
        pool.release(&[b0]);
        assert_eq!(pool.in_use(), 1);
        pool.release(&again);
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.available(), 3);
    }
}
