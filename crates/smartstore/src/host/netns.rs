//! Nodes on separate network stacks: "one node per host" on one machine.
//!
//! The paper's smart nodes are separate devices on a network, and its
//! redistribution scheme is communication-bound (section 3.3). Over
//! loopback, node-to-node transfers cost only memory copies. Here every
//! local node runs in a network namespace of its own, joined to the host's
//! namespace by a veth pair on one bridge, so each node has its own TCP
//! stack and its traffic crosses a real (virtual) link. A [`Link`] rate
//! shapes both directions of every node's link with tc's token-bucket
//! filter, as if each node had a NIC of that speed.
//!
//! ```text
//!   root namespace (the host, `rebound query`)
//!     bridge rb<id>br  10.<a>.<b>.1/24
//!       |-- veth rb<id>h<i> ==== rb<id>p<i>  in namespace rb<id>n<i>: node i, 10.<a>.<b>.<10+i>
//!       ...
//!   tbf on rb<id>h<i> (towards node i) and on rb<id>p<i> (from node i)
//! ```
//!
//! Traffic between two nodes crosses the sender's and the receiver's links,
//! each shaped. Creating namespaces needs root (`CAP_NET_ADMIN`) and the
//! `ip` and `tc` commands (iproute2). Everything is removed when the
//! [`Network`] is dropped; namespaces a killed host left behind are removed
//! by the next one.

use std::process::Command;

use crate::error::{Error, Result};

/// A node link's rate, in bits per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Bits per second; `None` for an unshaped link.
    pub bits_per_s: Option<u64>,
}

impl Link {
    /// Parses `unlimited` or a rate such as `1gbit`, `100mbit`, `10gbit`,
    /// `500kbit` (tc's units, powers of 1000).
    pub fn parse(s: &str) -> Result<Link> {
        let t = s.trim().to_ascii_lowercase();
        if t == "unlimited" {
            return Ok(Link { bits_per_s: None });
        }
        let bad = || {
            Error::Invalid(format!(
                "--link {s:?}: expected a rate such as 1gbit, 100mbit or 500kbit, or unlimited"
            ))
        };
        let (num, mult) = [
            ("gbit", 1_000_000_000u64),
            ("mbit", 1_000_000),
            ("kbit", 1_000),
        ]
        .iter()
        .find_map(|(u, m)| t.strip_suffix(u).map(|n| (n, *m)))
        .ok_or_else(bad)?;
        let n: f64 = num.trim().parse().map_err(|_| bad())?;
        let bits = n * mult as f64;
        if !(64_000.0..=400e9).contains(&bits) {
            return Err(Error::Invalid(format!(
                "--link {s:?}: a rate from 64kbit to 400gbit"
            )));
        }
        Ok(Link {
            bits_per_s: Some(bits as u64),
        })
    }

    /// As reports show it.
    pub fn name(&self) -> String {
        match self.bits_per_s {
            None => "unlimited".into(),
            Some(b) if b % 1_000_000_000 == 0 => format!("{}gbit", b / 1_000_000_000),
            Some(b) if b % 1_000_000 == 0 => format!("{}mbit", b / 1_000_000),
            Some(b) => format!("{}kbit", b / 1_000),
        }
    }
}

/// The namespaces, veths and bridge of one cluster's nodes.
#[derive(Debug)]
pub struct Network {
    id: String,
    subnet: (u8, u8),
    nodes: usize,
}

/// Runs one `ip` or `tc` command, naming it in the error.
fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| Error::Invalid(format!("--link needs `{cmd}` (iproute2): {e}")))?;
    if !out.status.success() {
        return Err(Error::Invalid(format!(
            "`{cmd} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Namespaces named by an earlier host whose process is gone.
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix("rb") else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('n') else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run("ip", &["netns", "del", name]);
            let _ = run("ip", &["link", "del", &format!("rb{pid}br")]);
        }
    }
}

impl Network {
    /// Creates the bridge and one namespace per node, each link shaped to
    /// `link`.
    pub fn create(nodes: usize, link: Link) -> Result<Network> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err(Error::Invalid(
                "--link puts every node in a network namespace of its own, which needs root".into(),
            ));
        }
        if nodes > 200 {
            return Err(Error::Invalid(format!(
                "--link: at most 200 nodes, not {nodes}"
            )));
        }
        remove_stale();
        let pid = std::process::id();
        let net = Network {
            id: pid.to_string(),
            subnet: (200 + (pid % 50) as u8, ((pid / 50) % 250) as u8),
            nodes: 0,
        };
        let mut net = net;
        let br = net.bridge();
        run("ip", &["link", "add", &br, "type", "bridge"])?;
        run(
            "ip",
            &["addr", "add", &format!("{}/24", net.addr(None)), "dev", &br],
        )?;
        run("ip", &["link", "set", &br, "up"])?;
        for i in 0..nodes {
            net.add_node(i, link)?;
        }
        Ok(net)
    }

    fn bridge(&self) -> String {
        format!("rb{}br", self.id)
    }

    /// Node `i`'s namespace.
    pub fn namespace(&self, i: usize) -> String {
        format!("rb{}n{i}", self.id)
    }

    /// Node `i`'s address (the bridge's for `None`).
    pub fn addr(&self, i: Option<usize>) -> String {
        let host = i.map_or(1, |i| 10 + i);
        format!("10.{}.{}.{host}", self.subnet.0, self.subnet.1)
    }

    fn add_node(&mut self, i: usize, link: Link) -> Result<()> {
        let ns = self.namespace(i);
        let (h, p) = (format!("rb{}h{i}", self.id), format!("rb{}p{i}", self.id));
        run("ip", &["netns", "add", &ns])?;
        self.nodes = i + 1;
        run(
            "ip",
            &["link", "add", &h, "type", "veth", "peer", "name", &p],
        )?;
        run("ip", &["link", "set", &p, "netns", &ns])?;
        run("ip", &["link", "set", &h, "master", &self.bridge()])?;
        run("ip", &["link", "set", &h, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns, "ip"];
            all.extend_from_slice(args);
            run("ip", &all)
        };
        inside(&[
            "addr",
            "add",
            &format!("{}/24", self.addr(Some(i))),
            "dev",
            &p,
        ])?;
        inside(&["link", "set", &p, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        if let Some(bits) = link.bits_per_s {
            let rate = format!("{bits}bit");
            // Enough tokens for 4 ms at the rate (a timer tick), at least
            // 64 KiB, so the bucket does not cap the rate it is given.
            let burst = format!("{}", (bits / 8 / 250).max(64 << 10));
            let tbf = [
                "qdisc", "add", "dev", "", "root", "tbf", "rate", &rate, "burst", &burst,
                "latency", "50ms",
            ];
            let mut towards = tbf;
            towards[3] = &h;
            run("tc", &towards)?;
            let mut from = vec!["netns", "exec", &ns, "tc"];
            let mut out = tbf;
            out[3] = &p;
            from.extend_from_slice(&out);
            run("ip", &from)?;
        }
        Ok(())
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = run("ip", &["netns", "del", &self.namespace(i)]);
        }
        let _ = run("ip", &["link", "del", &self.bridge()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_rates_parse_in_tc_units_and_bad_ones_are_refused() {
        assert_eq!(
            Link::parse("1gbit").unwrap().bits_per_s,
            Some(1_000_000_000)
        );
        assert_eq!(
            Link::parse("100Mbit").unwrap().bits_per_s,
            Some(100_000_000)
        );
        assert_eq!(
            Link::parse("2.5gbit").unwrap().bits_per_s,
            Some(2_500_000_000)
        );
        assert_eq!(Link::parse("unlimited").unwrap().bits_per_s, None);
        assert_eq!(Link::parse("1gbit").unwrap().name(), "1gbit");
        assert_eq!(Link::parse("100mbit").unwrap().name(), "100mbit");
        for bad in ["", "fast", "1gb", "-1gbit", "1kbit", "1000gbit", "nangbit"] {
            let e = Link::parse(bad).unwrap_err().to_string();
            assert!(e.contains("--link"), "{bad:?}: {e}");
        }
    }
}
