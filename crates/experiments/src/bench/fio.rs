//! fio's nbd engine as the experiments' client: one run, its JSON parsed.

use std::process::{Command, Stdio};

use anyhow::Context;

/// One fio job's result.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Fio {
    /// Completions per second, reads and writes.
    pub iops: f64,
    /// Mean completion latency, µs.
    pub mean_us: f64,
    /// 99th percentile completion latency (the worse direction), µs.
    pub p99_us: f64,
    /// I/Os completed, reads and writes.
    pub ios: u64,
    /// The server's CPU time (all threads, user and system) per completed
    /// I/O over the job, µs, where the caller measured it; 0 otherwise.
    pub server_cpu_us: f64,
    /// `server_cpu_us` by thread role (`threadcpu::ROLES`), where the
    /// caller measured it; zeroes otherwise.
    pub server_roles_us: [f64; 4],
    /// fio's own CPU time (its job processes, user and system) per
    /// completed I/O, µs: on a host whose cores fio shares with the
    /// server, a server that makes its client work harder per I/O (replies
    /// in small bursts, more wake-ups) loses throughput that its own CPU
    /// time does not show.
    pub client_cpu_us: f64,
}

/// CPU time of this process's children that have ended and been waited
/// for, user and system, µs (`getrusage(RUSAGE_CHILDREN)`).
fn children_cpu_us() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to fill.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable rusage for the call.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &raw mut u) } != 0 {
        return 0;
    }
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    us(u.ru_utime) + us(u.ru_stime)
}

/// Run fio's nbd engine against `127.0.0.1:port`: `job` is
/// "cache-standard" (random 4 KiB, 3 reads to 1 write, zoned as the shared
/// job file) or "write" (100% random 4 KiB writes), with `jobs` connections of `iodepth` requests in
/// flight.
pub(super) fn fio(port: u16, job: &str, runtime: u32, depth: (u32, u32)) -> anyhow::Result<Fio> {
    fio_ramped(port, job, 0, runtime, depth)
}

/// [`fio`] after `ramp` seconds of the same job, unmeasured (fio's
/// `ramp_time`): the load runs on without a pause into the measured
/// `runtime`, so whatever the warm-up built up (a full NVS, destage
/// behind) is still there when the measurement starts. A warm-up run as
/// a separate fio leaves a gap between the two in which the server is
/// idle and catches up (off's destage empties its NVS), and the measured
/// run starts from a state the load itself never sees.
pub(super) fn fio_ramped(
    port: u16,
    job: &str,
    ramp: u32,
    runtime: u32,
    (iodepth, jobs): (u32, u32),
) -> anyhow::Result<Fio> {
    // fio waits for its job processes, and this waits for fio: the
    // children's CPU time grows by fio's alone (no other child of this
    // process ends meanwhile: the server under test runs on).
    let children_before = children_cpu_us();
    let out = Command::new("fio")
        .args(job_args(port, job, ramp, runtime, (iodepth, jobs)))
        .stderr(Stdio::piped())
        .output()
        .context("running fio (apt-get install fio)")?;
    anyhow::ensure!(
        out.status.success(),
        "fio failed ({}) against nbd://127.0.0.1:{port}/ ({job}): {}",
        out.status,
        last_lines(&out.stderr, &out.stdout)
    );
    let start = out
        .stdout
        .iter()
        .position(|&b| b == b'{')
        .context("no JSON from fio")?;
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout[start..]).context("parsing fio's JSON output")?;
    let j = &v["jobs"][0];
    let mut r = Fio::default();
    let mut weighted = 0.0;
    for dir in ["read", "write"] {
        let d = &j[dir];
        let iops = d["iops"].as_f64().unwrap_or(0.0);
        r.iops += iops;
        r.ios += d["total_ios"].as_u64().unwrap_or(0);
        weighted += iops * d["clat_ns"]["mean"].as_f64().unwrap_or(0.0);
        let p99 = d["clat_ns"]["percentile"]["99.000000"]
            .as_f64()
            .unwrap_or(0.0);
        r.p99_us = r.p99_us.max(p99 / 1000.0);
    }
    anyhow::ensure!(r.iops > 0.0, "fio completed no I/O");
    if r.ios > 0 {
        // fio's CPU time is its whole run's, the ramp's too.
        let whole = children_cpu_us().saturating_sub(children_before) as f64;
        r.client_cpu_us = measured_share(whole, ramp, runtime) / r.ios as f64;
    }
    r.mean_us = weighted / r.iops / 1000.0;
    Ok(r)
}

/// fio's command line for one job: `ramp` seconds unmeasured, then
/// `runtime` measured, in one run.
fn job_args(
    port: u16,
    job: &str,
    ramp: u32,
    runtime: u32,
    (iodepth, jobs): (u32, u32),
) -> Vec<String> {
    let rw: &[&str] = match job {
        // The shared cache-standard job (bench/fio/cache-standard.fio):
        // 70% of accesses to 10% of the volume, the paper's read hit ratio.
        "cache-standard" => &[
            "--rw=randrw",
            "--rwmixread=75",
            "--random_distribution=zoned:70/10:30/90",
        ],
        _ => &["--rw=randwrite"],
    };
    let mut args = vec![
        format!("--name={job}"),
        "--ioengine=nbd".into(),
        format!("--uri=nbd://127.0.0.1:{port}/"),
        "--bs=4k".into(),
        format!("--iodepth={iodepth}"),
        format!("--numjobs={jobs}"),
        "--group_reporting=1".into(),
        "--size=1g".into(),
        "--time_based=1".into(),
        format!("--runtime={runtime}"),
        format!("--ramp_time={ramp}"),
        "--output-format=json".into(),
    ];
    args.extend(rw.iter().map(|a| (*a).to_string()));
    args
}

/// The share of fio's whole CPU time that falls in the measured part of
/// a run with a ramp: in proportion to its time (a finished child's time
/// is all `getrusage` gives).
fn measured_share(whole_us: f64, ramp: u32, runtime: u32) -> f64 {
    whole_us * f64::from(runtime) / f64::from(ramp + runtime)
}

/// The last few lines fio printed (stderr first, else stdout), for an
/// error message that says why it failed.
fn last_lines(stderr: &[u8], stdout: &[u8]) -> String {
    let text = if stderr.iter().any(|b| !b.is_ascii_whitespace()) {
        String::from_utf8_lossy(stderr)
    } else {
        String::from_utf8_lossy(stdout)
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(6)..];
    if tail.is_empty() {
        "it printed nothing".to_string()
    } else {
        tail.join(" | ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warm_up_is_the_measured_jobs_own_ramp_in_one_fio_run() {
        let args = job_args(10809, "write", 4, 8, (256, 8));
        for want in [
            "--ramp_time=4",
            "--runtime=8",
            "--time_based=1",
            "--rw=randwrite",
            "--iodepth=256",
            "--numjobs=8",
            "--uri=nbd://127.0.0.1:10809/",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
        }
        let mixed = job_args(10809, "cache-standard", 0, 3, (32, 1));
        assert!(mixed.iter().any(|a| a == "--ramp_time=0"));
        assert!(mixed.iter().any(|a| a == "--rwmixread=75"));
    }

    #[test]
    fn fios_cpu_time_is_shared_between_ramp_and_measurement_by_their_time() {
        assert!((measured_share(1200.0, 4, 8) - 800.0).abs() < 1e-9);
        assert!((measured_share(1200.0, 0, 8) - 1200.0).abs() < 1e-9);
    }

    #[test]
    fn the_childrens_cpu_time_grows_by_what_a_waited_for_child_spent() {
        let before = children_cpu_us();
        // A child that computes for a while, then is waited for.
        let status = Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"])
            .status()
            .unwrap();
        assert!(status.success());
        let spent = children_cpu_us() - before;
        assert!(spent > 10_000, "the child's CPU time counted: {spent} µs");
    }
}
