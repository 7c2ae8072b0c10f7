//! Invalid configurations are errors at build time that name the problem;
//! never a panic, never a silent fix.

use std::time::Duration;

use rcs::{Alternative, BuildError, GroupSpec, Policy, PoolId, QosLoops, Runtime, RuntimeBuilder};

fn one_group() -> RuntimeBuilder {
    let mut b = Runtime::builder();
    b.workers(2);
    b.group(GroupSpec::new("cache").pools([PoolId(0)]));
    b
}

fn message(b: &RuntimeBuilder) -> (BuildError, String) {
    let err = b.build().expect_err("configuration should be refused");
    let text = err.to_string();
    (err, text)
}

#[test]
fn sigma_zero_is_refused_naming_the_group() {
    let mut b = Runtime::builder();
    b.workers(1);
    b.group(GroupSpec::new("destage").sigma(0));
    let (err, text) = message(&b);
    assert!(matches!(err, BuildError::SigmaZero { ref group } if group == "destage"));
    assert!(
        text.contains("destage") && text.contains("sigma = 0"),
        "{text}"
    );
}

#[test]
fn a_group_mapped_to_no_pool_is_refused_under_static_and_partial() {
    for policy in [Policy::Static, Policy::Partial] {
        let mut b = one_group();
        b.policy(policy);
        b.group(GroupSpec::new("nvs"));
        let (err, text) = message(&b);
        assert!(matches!(err, BuildError::UnmappedGroup { ref group, .. } if group == "nvs"));
        assert!(
            text.contains("nvs") && text.contains(policy.name()),
            "{text}"
        );
    }
    // The dynamic and performance policies need no mapping.
    for policy in [Policy::Dynamic, Policy::Performance] {
        let mut b = one_group();
        b.policy(policy);
        b.group(GroupSpec::new("nvs"));
        assert!(b.build().is_ok());
    }
}

#[test]
fn a_mapping_to_an_unknown_pool_is_refused() {
    let mut b = one_group();
    b.group(GroupSpec::new("device").pools([PoolId(7)]));
    let (err, text) = message(&b);
    assert!(
        matches!(
            err,
            BuildError::UnknownPool {
                pool: 7,
                pools: 2,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(text.contains("device") && text.contains("#7"), "{text}");
    let mut b = one_group();
    b.group(GroupSpec::new("device").alternative(Alternative::Pools(vec![PoolId(2)])));
    assert!(matches!(
        message(&b).0,
        BuildError::UnknownPool { pool: 2, .. }
    ));
}

#[test]
fn more_pools_than_threads_is_refused() {
    let mut b = one_group();
    b.pools(3);
    let (err, text) = message(&b);
    assert!(matches!(
        err,
        BuildError::MorePoolsThanWorkers {
            pools: 3,
            workers: 2
        }
    ));
    assert!(
        text.contains("3 resource pools") && text.contains("2 worker"),
        "{text}"
    );
    let mut b = one_group();
    b.pool_sizes([1, 1, 1]);
    assert!(matches!(
        message(&b).0,
        BuildError::MorePoolsThanWorkers { .. }
    ));
}

#[test]
fn pool_sizes_must_add_up_and_be_positive() {
    let mut b = one_group();
    b.pool_sizes([1, 2]);
    assert!(matches!(
        message(&b).0,
        BuildError::PoolSizesMismatch {
            sum: 3,
            workers: 2,
            ..
        }
    ));
    let mut b = one_group();
    b.pool_sizes([2, 0]);
    assert!(matches!(message(&b).0, BuildError::EmptyPool { pool: 1 }));
    let mut b = one_group();
    b.pools(0);
    assert!(matches!(message(&b).0, BuildError::EmptyPool { .. }));
}

#[test]
fn a_lease_of_zero_is_refused() {
    let mut b = one_group();
    b.policy(Policy::Partial).lease_dispatches(0);
    let (err, text) = message(&b);
    assert!(matches!(err, BuildError::LeaseZero));
    assert!(text.contains("lease"), "{text}");
}

#[test]
fn zero_workers_or_too_many_is_refused() {
    let mut b = one_group();
    b.workers(0);
    assert!(matches!(message(&b).0, BuildError::NoWorkers));
    let mut b = one_group();
    b.workers(65);
    assert!(matches!(
        message(&b).0,
        BuildError::TooManyWorkers {
            workers: 65,
            max: 64
        }
    ));
}

#[test]
fn group_names_must_be_present_and_unique() {
    let mut b = Runtime::builder();
    b.workers(1);
    assert!(matches!(message(&b).0, BuildError::NoGroups));
    b.group(GroupSpec::new(""));
    assert!(matches!(
        message(&b).0,
        BuildError::EmptyGroupName { index: 0 }
    ));
    let mut b = one_group();
    b.group(GroupSpec::new("cache"));
    let (err, text) = message(&b);
    assert!(matches!(err, BuildError::DuplicateGroup { ref name } if name == "cache"));
    assert!(text.contains("defined twice"), "{text}");
}

#[test]
fn more_than_64_groups_is_refused() {
    let mut b = Runtime::builder();
    b.workers(1);
    for i in 0..65 {
        b.group(GroupSpec::new(format!("g{i}")));
    }
    assert!(matches!(
        message(&b).0,
        BuildError::TooManyGroups {
            groups: 65,
            max: 64
        }
    ));
}

#[test]
fn loop_counts_capacity_probability_and_timeout_are_range_checked() {
    let mut b = one_group();
    b.qos(QosLoops {
        high_loop_count: 0,
        medium_loop_count: 1,
    });
    assert!(matches!(
        message(&b).0,
        BuildError::LoopCount {
            which: "high",
            value: 0,
            ..
        }
    ));
    let mut b = one_group();
    b.qos(QosLoops {
        high_loop_count: 1,
        medium_loop_count: 100_000,
    });
    assert!(matches!(
        message(&b).0,
        BuildError::LoopCount {
            which: "medium",
            ..
        }
    ));
    let mut b = one_group();
    b.queue_capacity(0);
    assert!(matches!(
        message(&b).0,
        BuildError::QueueCapacity { value: 0, .. }
    ));
    let mut b = one_group();
    b.group(GroupSpec::new("x").inject_faults(2.0, Duration::ZERO));
    assert!(matches!(message(&b).0, BuildError::FaultProbability { .. }));
    let mut b = one_group();
    b.group(GroupSpec::new("x").inject_faults(f64::NAN, Duration::ZERO));
    assert!(matches!(message(&b).0, BuildError::FaultProbability { .. }));
    let mut b = one_group();
    b.idle_spins(u32::MAX);
    assert!(matches!(message(&b).0, BuildError::IdleSpins { .. }));
    let mut b = one_group();
    b.drain_timeout(Duration::ZERO);
    assert!(matches!(message(&b).0, BuildError::DrainTimeout(_)));
    let mut b = Runtime::builder();
    b.workers(1);
    b.group(GroupSpec::new("x").sigma(1 << 20));
    assert!(matches!(message(&b).0, BuildError::SigmaTooLarge { .. }));
}

#[test]
fn policy_and_failure_class_names_parse_with_clear_errors() {
    for p in Policy::ALL {
        assert_eq!(p.name().parse::<Policy>().unwrap(), p);
    }
    assert_eq!(
        "partial-dynamic".parse::<Policy>().unwrap(),
        Policy::Partial
    );
    let err = "fastest".parse::<Policy>().unwrap_err();
    assert!(err.contains("fastest") && err.contains("dynamic"), "{err}");
    for c in rcs::FailureClass::ALL {
        assert_eq!(c.name().parse::<rcs::FailureClass>().unwrap(), c);
    }
    assert!(
        "oops"
            .parse::<rcs::FailureClass>()
            .unwrap_err()
            .contains("internal-logic")
    );
}
