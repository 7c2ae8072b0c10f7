//! Named fault points: disarmed by default, armed by name (even before the
//! code first runs), firing with the configured action, count and probability.

use std::time::{Duration, Instant};

use rcs::fault::{self, FaultAction, FaultConfig};
use rcs::{FailureClass, fault_point};

fn stage() -> Result<(), rcs::Failure> {
    fault_point!("test.stage")?;
    Ok(())
}

fn destage() -> Result<(), rcs::Failure> {
    fault_point!("test.destage")?;
    Ok(())
}

#[test]
fn a_disarmed_point_passes_and_an_armed_one_fails_with_its_class() {
    assert!(stage().is_ok());
    fault::arm(
        "test.stage",
        FaultConfig::always(FaultAction::Fail(FailureClass::State)),
    )
    .unwrap();
    for _ in 0..3 {
        let err = stage().unwrap_err();
        assert_eq!(err.class(), FailureClass::State);
        assert!(err.message().contains("test.stage"));
    }
    assert!(fault::disarm("test.stage"));
    assert!(stage().is_ok());
    let info = fault::fault_points()
        .into_iter()
        .find(|p| p.name == "test.stage")
        .unwrap();
    assert!(info.registered);
    assert_eq!(info.triggered, 3);
    assert!(info.armed.is_none());
}

#[test]
fn a_point_can_be_armed_before_it_first_runs_and_fires_count_times() {
    fault::arm(
        "test.destage",
        FaultConfig {
            action: FaultAction::Fail(FailureClass::Timeout),
            probability: 1.0,
            count: Some(2),
        },
    )
    .unwrap();
    assert!(destage().is_err());
    assert!(destage().is_err());
    assert!(destage().is_ok(), "disarmed after its count");
    assert!(!fault::disarm("test.destage"));
}

#[test]
fn delay_and_panic_actions() {
    fn slow() -> Result<(), rcs::Failure> {
        fault_point!("test.slow")
    }
    fn boom() -> Result<(), rcs::Failure> {
        fault_point!("test.boom")
    }
    fault::arm(
        "test.slow",
        FaultConfig::once(FaultAction::Delay(Duration::from_millis(30))),
    )
    .unwrap();
    let t = Instant::now();
    assert!(slow().is_ok());
    assert!(t.elapsed() >= Duration::from_millis(30));
    fault::arm("test.boom", FaultConfig::once(FaultAction::Panic)).unwrap();
    assert!(std::panic::catch_unwind(boom).is_err());
    assert!(boom().is_ok());
}

#[test]
fn probability_fires_about_that_often() {
    fn sometimes() -> Result<(), rcs::Failure> {
        fault_point!("test.sometimes")
    }
    fault::arm(
        "test.sometimes",
        FaultConfig {
            action: FaultAction::Fail(FailureClass::Range),
            probability: 0.25,
            count: None,
        },
    )
    .unwrap();
    let fired = (0..4000).filter(|_| sometimes().is_err()).count();
    fault::disarm("test.sometimes");
    assert!((700..1300).contains(&fired), "{fired} of 4000 at p = 0.25");
}

#[test]
fn bad_arm_requests_are_refused() {
    assert!(fault::arm("", FaultConfig::once(FaultAction::Panic)).is_err());
    let err = fault::arm(
        "x",
        FaultConfig {
            action: FaultAction::Panic,
            probability: 1.5,
            count: None,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("1.5"));
}
