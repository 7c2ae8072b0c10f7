//! The handshake fed generated client byte streams, in memory: the
//! proptest side of the cargo-fuzz target `handshake`
//! (`crates/controller/fuzz`), checked by the same
//! [`check_handshake`](crate::fuzzing::check_handshake) (its module docs list
//! the invariants).
//!
//! Two generators: raw bytes (what a confused or hostile peer sends), and
//! structured streams built by [`client_stream`] from choice bytes (valid
//! or bad client flags, every option the server knows and unknown ones,
//! right or mutated lengths, names of this export and others, bytes of the
//! transmission phase, the whole cut at a random point), so that most
//! cases get past the greeting into the options. Both draw `u64` words
//! and use their bytes: a debug build of proptest generates a word about
//! as fast as a byte. Case counts scale with `REBOUND_FUZZ_CASES`
//! ([`cases`]).

use std::cell::RefCell;
use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::fuzzing::{Duplex, cases, check_handshake, client_stream, test_export};
use crate::nbd::handshake::{HandshakeError, OPTION_DATA_MAX, Outcome, negotiate};
use crate::nbd::proto::{FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, IHAVEOPT, opt};

/// Cases of the raw-bytes generator.
const RAW_CASES: u32 = 30_000;
/// Cases of the structured generator.
const STRUCTURED_CASES: u32 = 45_000;

fn config(base: u32) -> Config {
    Config {
        cases: cases(base),
        // Failures are reported with their shrunk input; nothing is
        // written next to the sources.
        failure_persistence: None,
        ..Config::default()
    }
}

/// Up to `words_max` random words as bytes, the last cut by 0 to 7 bytes.
fn words(words_max: usize) -> impl Strategy<Value = Vec<u8>> {
    (prop::collection::vec(any::<u64>(), 0..words_max), 0usize..8).prop_map(|(w, cut)| {
        let mut b: Vec<u8> = w.iter().flat_map(|x| x.to_be_bytes()).collect();
        b.truncate(b.len().saturating_sub(cut));
        b
    })
}

/// A short name for an outcome, to count which ones the generator reaches.
fn outcome_name(r: &Result<Outcome, HandshakeError>) -> &'static str {
    match r {
        Ok(Outcome::Transmission(n)) if n.allocation => "Transmission(allocation)",
        Ok(Outcome::Transmission(n)) if n.structured => "Transmission(structured)",
        Ok(Outcome::Transmission(_)) => "Transmission",
        Ok(Outcome::Aborted) => "Aborted",
        Ok(Outcome::StartTls { .. }) => "StartTls",
        Err(HandshakeError::Io(_)) => "Io",
        Err(HandshakeError::BadClientFlags(_)) => "BadClientFlags",
        Err(HandshakeError::BadOptionMagic(_)) => "BadOptionMagic",
        Err(HandshakeError::OptionTooLarge { .. }) => "OptionTooLarge",
        Err(HandshakeError::TooManyOptions) => "TooManyOptions",
        Err(HandshakeError::UnknownExport(_)) => "UnknownExport",
        Err(HandshakeError::Refused(_)) => "Refused",
        Err(HandshakeError::TlsRequired) => "TlsRequired",
    }
}

/// Run `strategy` through the checker; return how often each outcome
/// was reached.
fn run(base_cases: u32, strategy: impl Strategy<Value = Vec<u8>>) -> BTreeMap<&'static str, u32> {
    let seen = RefCell::new(BTreeMap::new());
    let export = test_export();
    let mut runner = TestRunner::new(config(base_cases));
    let result = runner.run(&strategy, |client| {
        let outcome = check_handshake(&client, &export);
        *seen.borrow_mut().entry(outcome_name(&outcome)).or_insert(0) += 1;
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    seen.into_inner()
}

#[test]
fn handshake_on_arbitrary_bytes_never_panics_and_answers_well_formed() {
    let seen = run(RAW_CASES, words(32));
    assert!(seen.contains_key("BadClientFlags") && seen.contains_key("Io"));
}

#[test]
fn handshake_on_generated_option_streams_keeps_every_property() {
    let seen = run(STRUCTURED_CASES, words(24).prop_map(|c| client_stream(&c)));
    // The generator must get deep: every way negotiation ends is reached
    // (at the suite's case count; a scaled-down run may miss rare ones).
    if cases(STRUCTURED_CASES) >= STRUCTURED_CASES {
        for outcome in [
            "Transmission",
            "Transmission(structured)",
            "Transmission(allocation)",
            "Aborted",
            "Io",
            "BadClientFlags",
            "BadOptionMagic",
            "OptionTooLarge",
            "TooManyOptions",
            "UnknownExport",
        ] {
            assert!(
                seen.contains_key(outcome),
                "no generated stream ended in {outcome}: {seen:?}"
            );
        }
    }
}

/// An option header declaring `length` bytes of data, after valid flags.
fn declaring(option: u32, length: u32) -> Vec<u8> {
    let mut s = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    s.extend_from_slice(&IHAVEOPT.to_be_bytes());
    s.extend_from_slice(&option.to_be_bytes());
    s.extend_from_slice(&length.to_be_bytes());
    s
}

#[test]
fn a_declared_4_gib_option_is_refused_without_reading_or_allocating_it() {
    for option in [opt::GO, opt::INFO, opt::EXPORT_NAME, opt::LIST, 0xdead] {
        let mut client = declaring(option, u32::MAX);
        client.extend_from_slice(&[0u8; 64]);
        let mut duplex = Duplex::new(&client);
        let started = std::time::Instant::now();
        let r = negotiate(&mut duplex, &test_export());
        assert!(
            matches!(
                r,
                Err(HandshakeError::OptionTooLarge {
                    length: u32::MAX,
                    ..
                })
            ),
            "{r:?}"
        );
        assert_eq!(
            duplex.consumed_bytes(),
            4 + 16,
            "nothing read past the header"
        );
        assert!(duplex.read_buffer_max_bytes <= 8, "no buffer for the data");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }
}

proptest! {
    #![proptest_config(config(2_000))]
    #[test]
    fn any_declared_length_over_the_limit_ends_negotiation_before_its_data(
        option in prop_oneof![Just(opt::GO), Just(opt::SET_META_CONTEXT), any::<u32>()],
        length in (OPTION_DATA_MAX + 1)..=u32::MAX,
    ) {
        let r = check_handshake(&declaring(option, length), &test_export());
        prop_assert!(matches!(r, Err(HandshakeError::OptionTooLarge { .. })), "{:?}", r);
    }

    #[test]
    fn a_go_for_this_export_after_any_options_enters_transmission(
        options in prop::collection::vec(
            prop_oneof![Just(opt::LIST), Just(opt::INFO), Just(opt::STRUCTURED_REPLY), Just(opt::STARTTLS)],
            0..6,
        ),
        name in prop_oneof![Just(""), Just("rebound")],
        asked in prop::collection::vec(0u16..4, 0..4),
    ) {
        let mut s = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
        let mut put = |code: u32, data: &[u8]| {
            s.extend_from_slice(&IHAVEOPT.to_be_bytes());
            s.extend_from_slice(&code.to_be_bytes());
            s.extend_from_slice(&(data.len() as u32).to_be_bytes());
            s.extend_from_slice(data);
        };
        let mut go = (name.len() as u32).to_be_bytes().to_vec();
        go.extend_from_slice(name.as_bytes());
        go.extend_from_slice(&(asked.len() as u16).to_be_bytes());
        for a in &asked {
            go.extend_from_slice(&a.to_be_bytes());
        }
        let mut structured = false;
        for o in &options {
            // INFO with the GO data: valid; the others take no data.
            put(*o, if *o == opt::INFO { &go } else { &[] });
            structured |= *o == opt::STRUCTURED_REPLY;
        }
        put(opt::GO, &go);
        let r = check_handshake(&s, &test_export());
        prop_assert!(
            matches!(r, Ok(Outcome::Transmission(n)) if n.structured == structured),
            "{:?}", r
        );
    }
}

#[test]
fn the_cargo_fuzz_seed_corpora_pass_the_checkers() {
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for (target, run) in [
        ("handshake", crate::fuzzing::handshake as fn(&[u8])),
        ("request_header", |d: &[u8]| {
            assert!(crate::fuzzing::request_header(d).is_some_and(|v| v.is_ok()));
        }),
    ] {
        let seeds = std::fs::read_dir(corpus.join(target)).expect("the seed corpus");
        let mut n = 0;
        for seed in seeds {
            run(&std::fs::read(seed.unwrap().path()).unwrap());
            n += 1;
        }
        assert!(n > 0, "no seeds for {target}");
    }
}
