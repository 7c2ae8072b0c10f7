//! The metrics endpoint over HTTP in-process: a controller on a temp dir,
//! its `MetricsServer` on a loopback port, scraped as Prometheus or
//! `curl` would.

use std::io::{Read, Write};
use std::net::TcpStream;

use crate::control::http::MetricsServer;
use crate::controller::Controller;

/// `GET path` with HTTP/1.0: the status line, the headers and the body.
fn get(addr: std::net::SocketAddr, path: &str) -> (String, String, String) {
    let mut s = TcpStream::connect(addr).expect("connecting to the endpoint");
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a header block");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_owned(), headers.to_owned(), body.to_owned())
}

#[test]
fn metrics_are_served_as_openmetrics_text_and_anything_else_is_404() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ctl = Controller::open(super::temp_config(dir.path())).expect("opening the controller");
    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), &ctl).expect("binding");
    let (status, headers, body) = get(server.local_addr(), "/metrics");
    assert!(status.contains(" 200 "), "{status}");
    let content_type = headers
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_owned())
        })
        .expect("a Content-Type header");
    assert_eq!(content_type, crate::metrics::CONTENT_TYPE);
    assert!(body.contains("# TYPE rebound_request_duration_seconds histogram\n"));
    assert!(body.contains("# TYPE rebound_recovery_duration_seconds histogram\n"));
    assert!(body.ends_with("# EOF\n"), "{body}");
    let (status, _, _) = get(server.local_addr(), "/");
    assert!(status.contains(" 404 "), "{status}");
    drop(server);
    ctl.shutdown().expect("shutdown");
}
