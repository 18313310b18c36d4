//! Every fuzz target on stable, bounded: its seed corpus, then mutations of it (bit flips,
//! interesting bytes, inserts, deletes, duplicated and spliced runs) from a fixed seed, so a
//! run is repeatable and its cost known. libFuzzer's coverage-guided runs (`make fuzz`) go
//! much further; this keeps every target running on every change.

use std::path::Path;

/// Mutated inputs per target and seed file.
const MUTATIONS: usize = 20_000;

/// xorshift64*: enough randomness for mutations, repeatable from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: &[u8] = &[
    0, 1, 0x7f, 0x80, 0xff, b'"', b'{', b'}', b'[', b']', b'\\', 0xc0, 0xdc, 0xdd, 0xce, 0xcf,
];

fn mutate(input: &mut Vec<u8>, others: &[Vec<u8>], rng: &mut Rng) {
    for _ in 0..1 + rng.below(4) {
        let len = input.len();
        match rng.below(7) {
            0 if len > 0 => {
                let at = rng.below(len);
                input[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                input[at] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let at = rng.below(len + 1);
                input.insert(at, rng.next() as u8);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(16));
                input.drain(at..at + n);
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                let run: Vec<u8> = input[at..at + n].to_vec();
                let to = rng.below(len + 1);
                input.splice(to..to, run);
            }
            5 if !others.is_empty() => {
                let other = &others[rng.below(others.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            _ => input.truncate(rng.below(len + 1)),
        }
    }
}

#[test]
fn every_target_survives_its_corpus_and_mutations() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (name, target) in kvroute_fuzz::TARGETS {
        let dir = root.join(name);
        let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| std::fs::read(entry.unwrap().path()).unwrap())
            .collect();
        seeds.sort();
        assert!(!seeds.is_empty(), "{name}: no seed in {}", dir.display());
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
        let mut runs = 0;
        for seed in &seeds {
            target(seed);
            for _ in 0..MUTATIONS {
                let mut input = seed.clone();
                mutate(&mut input, &seeds, &mut rng);
                let outcome = std::panic::catch_unwind(|| target(&input));
                if let Err(panic) = outcome {
                    eprintln!("{name} panicked on {} bytes: {input:02x?}", input.len());
                    std::panic::resume_unwind(panic);
                }
                runs += 1;
            }
        }
        eprintln!("{name}: {} seeds, {runs} mutated inputs", seeds.len());
    }
}
