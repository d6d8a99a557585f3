//! The service end to end over loopback: server and clients in one process.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::wire::{
    op, read_greeting, read_response, status, write_auth, write_request, MAGIC, NO_TIMEOUT,
};
use super::{KvClient, KvError, KvServer, ServerOptions, MAX_STORED_BYTES};
use crate::token::RunToken;

const SEC5: Duration = Duration::from_secs(5);

fn server(n: u32) -> (KvServer, String) {
    let server = KvServer::start("127.0.0.1:0".parse().unwrap(), n).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

fn clients(addr: &str, n: u32) -> Vec<Arc<KvClient>> {
    (0..n)
        .map(|p| Arc::new(KvClient::connect(addr, p, n, SEC5).unwrap()))
        .collect()
}

/// A server of `n` processes that requires `token`.
fn server_with_token(n: u32, token: &str) -> (KvServer, String) {
    let options = ServerOptions {
        run_token: Some(RunToken::new(token).unwrap()),
        ..ServerOptions::default()
    };
    let server = KvServer::start_with("127.0.0.1:0".parse().unwrap(), n, options).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

fn with_token(addr: &str, p: u32, n: u32, token: &str) -> Result<KvClient, KvError> {
    KvClient::connect_with_token(addr, p, n, SEC5, Some(RunToken::new(token).unwrap()))
}

/// A raw connection past the greeting of a server without a token.
fn raw(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(SEC5)).unwrap();
    let (needs_token, _) = read_greeting(&mut s).ok().unwrap();
    assert!(!needs_token);
    write_auth(&mut s, None).unwrap();
    assert!(matches!(read_response(&mut s), Ok((status::OK, _))));
    s
}

/// Whether the server closed `s` (rather than leave it waiting). A close
/// with our bytes unread reaches us as a reset.
fn closed(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// Waits (bounded) until the server has `n` gets waiting.
fn until_waiting(server: &KvServer, n: usize) {
    let deadline = Instant::now() + SEC5;
    while server.waiting_gets() < n {
        assert!(Instant::now() < deadline, "waiters never arrived");
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn concurrent_blocking_gets() {
    let (server, addr) = server(4);
    let cs = clients(&addr, 4);
    let handles: Vec<_> = (0..16)
        .map(|t| {
            let c = Arc::clone(&cs[t % 3]);
            thread::spawn(move || {
                let key = format!("k{}", t % 8);
                (t, c.get(&key, SEC5))
            })
        })
        .collect();
    until_waiting(&server, 16);
    for k in 0..8 {
        cs[3]
            .set(&format!("k{k}"), format!("value {k}").as_bytes())
            .unwrap();
    }
    for h in handles {
        let (t, got) = h.join().unwrap();
        assert_eq!(got.unwrap(), format!("value {}", t % 8).as_bytes());
    }
    let start = Instant::now();
    assert_eq!(cs[1].get("k5", SEC5).unwrap(), b"value 5");
    assert!(start.elapsed() < Duration::from_millis(500));
}

#[test]
fn get_times_out_and_try_get_does_not_block() {
    let (_server, addr) = server(1);
    let c = KvClient::connect(&addr, 0, 1, SEC5).unwrap();
    let start = Instant::now();
    let err = c.get("absent", Duration::from_millis(300)).unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(&err, KvError::Timeout { key, .. } if key == "absent"),
        "{err}"
    );
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(
        err.to_string(),
        "timed out after 300 ms waiting for key `absent`"
    );
    assert_eq!(c.try_get("absent").unwrap(), None);
    c.set("present", b"x").unwrap();
    assert_eq!(c.try_get("present").unwrap(), Some(b"x".to_vec()));
}

#[test]
fn repeated_key_last_set_wins_and_waiter_sees_first() {
    let (server, addr) = server(2);
    let cs = clients(&addr, 2);
    let waiter = {
        let c = Arc::clone(&cs[0]);
        thread::spawn(move || c.get("k", SEC5))
    };
    until_waiting(&server, 1);
    cs[1].set("k", b"a").unwrap();
    cs[1].set("k", b"b").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), b"a");
    assert_eq!(cs[0].get("k", SEC5).unwrap(), b"b");
    assert_eq!(server.waiting_gets(), 0);
}

#[test]
fn binary_values_and_odd_keys_round_trip() {
    let (_server, addr) = server(1);
    let c = KvClient::connect(&addr, 0, 1, SEC5).unwrap();
    let all: Vec<u8> = (0..=255).collect();
    let big: Vec<u8> = (0..4 << 20).map(|i: u32| (i * 7 + i / 251) as u8).collect();
    c.set("all/bytes", &all).unwrap();
    c.set("empty", &[]).unwrap();
    c.set("big", &big).unwrap();
    c.set("ключ/ü/🔑", b"unicode").unwrap();
    assert_eq!(c.get("all/bytes", SEC5).unwrap(), all);
    assert_eq!(c.get("empty", SEC5).unwrap(), Vec::<u8>::new());
    assert_eq!(c.try_get("empty").unwrap(), Some(Vec::new()));
    assert!(c.get("big", SEC5).unwrap() == big);
    assert_eq!(c.get("ключ/ü/🔑", SEC5).unwrap(), b"unicode");
}

#[test]
fn barrier_passes_with_all_and_names_the_missing() {
    let (_server, addr) = server(4);
    let cs = clients(&addr, 4);
    let all: Vec<_> = cs
        .iter()
        .map(|c| {
            let c = Arc::clone(c);
            thread::spawn(move || c.barrier("start", SEC5))
        })
        .collect();
    for h in all {
        h.join().unwrap().unwrap();
    }
    // The name may be used again once the barrier completed.
    let three: Vec<_> = [0usize, 1, 3]
        .iter()
        .map(|&i| {
            let c = Arc::clone(&cs[i]);
            thread::spawn(move || c.barrier("start", Duration::from_millis(300)))
        })
        .collect();
    for h in three {
        match h.join().unwrap().unwrap_err() {
            KvError::BarrierTimeout { name, missing, .. } => {
                assert_eq!(name, "start");
                assert_eq!(missing, vec![2]);
            }
            other => panic!("{other}"),
        }
    }
    let err = KvError::BarrierTimeout {
        name: "start".into(),
        missing: vec![1, 3],
        num_processes: 4,
        waited: SEC5,
    };
    assert_eq!(
        err.to_string(),
        "processes 1, 3 of 4 never reached `start` within 5 s"
    );
}

#[test]
fn shutdown_waits_for_every_process() {
    let (server, addr) = server(3);
    let cs = clients(&addr, 3);
    let (tx, rx) = mpsc::channel();
    let early: Vec<_> = [0usize, 1]
        .iter()
        .map(|&i| {
            let c = Arc::clone(&cs[i]);
            let tx = tx.clone();
            thread::spawn(move || {
                c.shutdown(SEC5).unwrap();
                tx.send((i, Instant::now())).unwrap();
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    assert!(
        rx.try_recv().is_err(),
        "shutdown returned before process 2 was done"
    );
    let last_called = Instant::now();
    cs[2].shutdown(SEC5).unwrap();
    for h in early {
        h.join().unwrap();
    }
    for _ in 0..2 {
        let (_, at) = rx.recv().unwrap();
        assert!(at >= last_called);
    }
    // A normal end: watch says so, and closing the clients loses no one.
    assert!(cs[0].watch().is_ok());
    drop(cs);
    drop(server);
}

#[test]
fn dropped_client_is_a_lost_peer() {
    let (_server, addr) = server(3);
    let mut cs = clients(&addr, 3);
    let pending = {
        let c = Arc::clone(&cs[2]);
        thread::spawn(move || c.get("never", Duration::from_secs(8)))
    };
    let watcher = {
        let c = Arc::clone(&cs[0]);
        thread::spawn(move || c.watch())
    };
    thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    drop(cs.remove(1));
    let err = pending.join().unwrap().unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
    assert_eq!(err.to_string(), "process 1 left the run without finishing");
    let err = watcher.join().unwrap().unwrap_err();
    assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
    // Later waits fail at once too.
    let err = cs[0].barrier("b", SEC5).unwrap_err();
    assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
    let err = cs[1].shutdown(SEC5).unwrap_err();
    assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
    // And the lost id cannot come back.
    let err = KvClient::connect(&addr, 1, 3, SEC5).unwrap_err();
    assert!(matches!(err, KvError::Refused { .. }), "{err}");
}

#[test]
fn stopped_server_is_a_lost_coordinator() {
    let (server, addr) = server(2);
    let cs = clients(&addr, 2);
    let watcher = {
        let c = Arc::clone(&cs[1]);
        thread::spawn(move || c.watch())
    };
    let pending = {
        let c = Arc::clone(&cs[0]);
        thread::spawn(move || c.get("never", Duration::from_secs(8)))
    };
    thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    drop(server);
    let err = watcher.join().unwrap().unwrap_err();
    assert!(
        matches!(&err, KvError::CoordinatorLost { addr: a } if *a == addr),
        "{err}"
    );
    let err = pending.join().unwrap().unwrap_err();
    assert!(matches!(err, KvError::CoordinatorLost { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(matches!(
        cs[0].set("k", b"v"),
        Err(KvError::CoordinatorLost { .. })
    ));
}

#[test]
fn connect_errors() {
    // A port where nothing listens.
    let free = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let start = Instant::now();
    let err = KvClient::connect(&free.to_string(), 1, 2, Duration::from_millis(500)).unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(err, KvError::Unreachable { process: 1, .. }),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    assert!(
        err.to_string().starts_with(&format!(
            "process 1 of 2 could not reach the coordinator {free} within 500 ms"
        )),
        "{err}"
    );

    let (_server, addr) = server(2);
    let _first = KvClient::connect(&addr, 1, 2, SEC5).unwrap();
    let err = KvClient::connect(&addr, 1, 2, SEC5).unwrap_err();
    assert!(matches!(err, KvError::Refused { .. }), "{err}");
    let err = KvClient::connect(&addr, 2, 2, SEC5).unwrap_err();
    assert!(matches!(err, KvError::Refused { .. }), "{err}");
    let err = KvClient::connect(&addr, 2, 3, SEC5).unwrap_err();
    assert!(
        matches!(
            err,
            KvError::CountMismatch {
                process: 2,
                theirs: 3,
                ours: 2
            }
        ),
        "{err}"
    );
    // A process started before the coordinator still gets in.
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let late = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        KvServer::start(port, 1).unwrap()
    });
    let c = KvClient::connect(&port.to_string(), 0, 1, SEC5).unwrap();
    c.set("up", b"1").unwrap();
    drop(c);
    drop(late.join().unwrap());
}

#[test]
fn malformed_frame_closes_only_that_connection() {
    let (_server, addr) = server(1);
    let c = KvClient::connect(&addr, 0, 1, SEC5).unwrap();
    let mut raw = raw(&addr);
    raw.write_all(&[99, 0, 0, 0, 0]).unwrap();
    match read_response(&mut raw) {
        Ok((status::PROTOCOL, _)) => {}
        _ => panic!("expected a protocol complaint"),
    }
    let mut rest = Vec::new();
    assert_eq!(raw.read_to_end(&mut rest).map(|n| n == 0).ok(), Some(true));
    // A value length over the limit.
    let mut raw = self::raw(&addr);
    let mut frame = vec![op::SET, 0, 0, 0, 0];
    frame.extend_from_slice(&0u64.to_be_bytes());
    frame.extend_from_slice(&1u32.to_be_bytes());
    frame.push(b'k');
    frame.extend_from_slice(&u64::MAX.to_be_bytes());
    raw.write_all(&frame).unwrap();
    assert!(matches!(read_response(&mut raw), Ok((status::PROTOCOL, _))));
    c.set("still", b"fine").unwrap();
    assert_eq!(c.get("still", SEC5).unwrap(), b"fine");
}

#[test]
fn client_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<KvClient>();
    check::<KvServer>();
}

#[test]
fn a_stranger_without_the_token_takes_no_id_and_the_run_goes_on() {
    let (_server, addr) = server_with_token(2, "the-run-secret");
    let p0 = Arc::new(with_token(&addr, 0, 2, "the-run-secret").unwrap());
    let joined = {
        let p0 = Arc::clone(&p0);
        thread::spawn(move || p0.barrier("join", Duration::from_secs(20)))
    };
    // A stranger that skips the proof and claims process 1 is closed unheard.
    let mut stranger = TcpStream::connect(&addr).unwrap();
    stranger.set_read_timeout(Some(SEC5)).unwrap();
    let (needs_token, _) = read_greeting(&mut stranger).ok().unwrap();
    assert!(needs_token);
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&2u32.to_be_bytes());
    let _ = write_request(&mut stranger, op::HELLO, 1, NO_TIMEOUT, "", &hello);
    assert!(closed(&mut stranger));
    // One that sends a made-up proof, then a hello and a set anyway.
    let mut stranger = TcpStream::connect(&addr).unwrap();
    stranger.set_read_timeout(Some(SEC5)).unwrap();
    read_greeting(&mut stranger).ok().unwrap();
    write_auth(&mut stranger, Some(&([7; 32], [9; 32]))).unwrap();
    assert!(matches!(
        read_response(&mut stranger),
        Ok((status::AUTH_FAILED, _))
    ));
    let _ = write_request(&mut stranger, op::HELLO, 1, NO_TIMEOUT, "", &hello);
    let _ = write_request(&mut stranger, op::SET, 1, NO_TIMEOUT, "evil", b"x");
    assert!(closed(&mut stranger));
    // Our own client without the token, or with another, is told so.
    let err = KvClient::connect(&addr, 1, 2, SEC5).unwrap_err();
    assert!(matches!(err, KvError::TokenRequired { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "the rendezvous at {addr} requires a run token (HLO_TRAIN_RUN_TOKEN) and this process has none"
        )
    );
    let err = with_token(&addr, 1, 2, "a-guess").unwrap_err();
    assert!(matches!(err, KvError::TokenMismatch { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!("this process's run token differs from process 0's (the rendezvous at {addr} refused it)")
    );
    // None of them took process 1, set a key or counted as a lost peer:
    // the real process 1 joins and the run ends normally.
    let p1 = with_token(&addr, 1, 2, "the-run-secret").unwrap();
    p1.barrier("join", SEC5).unwrap();
    joined.join().unwrap().unwrap();
    assert_eq!(p1.try_get("evil").unwrap(), None);
    let done = {
        let p0 = Arc::clone(&p0);
        thread::spawn(move || p0.shutdown(SEC5))
    };
    p1.shutdown(SEC5).unwrap();
    done.join().unwrap().unwrap();
    assert!(p0.watch().is_ok());
}

#[test]
fn token_and_no_token_are_told_apart_both_ways() {
    let (_server, addr) = server(1);
    let err = with_token(&addr, 0, 1, "secret").unwrap_err();
    assert!(matches!(err, KvError::TokenUnexpected { .. }), "{err}");
    assert!(err.to_string().contains(&addr), "{err}");
    assert!(!err.to_string().contains("secret "), "{err}");
    // A server that cannot prove the token is not taken for the run's.
    let (_other, addr) = server_with_token(1, "another-run");
    let err = with_token(&addr, 0, 1, "secret").unwrap_err();
    assert!(matches!(err, KvError::TokenMismatch { .. }), "{err}");
}

/// A loopback proxy to `upstream` that keeps every byte either way.
fn recording_proxy(upstream: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&seen);
    thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(&upstream) else {
                return;
            };
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                let kept = Arc::clone(&kept);
                thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        kept.lock().unwrap().extend_from_slice(&buf[..n]);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
    (addr, seen)
}

#[test]
fn the_token_never_crosses_the_wire() {
    let token = "do-not-send-me-0123456789abcdef";
    let (_server, addr) = server_with_token(2, token);
    let (proxy, seen) = recording_proxy(addr);
    let other = {
        let proxy = proxy.clone();
        thread::spawn(move || {
            let c = with_token(&proxy, 1, 2, token).unwrap();
            c.set("k", b"v").unwrap();
            c.barrier("b", SEC5).unwrap();
            c.shutdown(SEC5).unwrap();
        })
    };
    let c = with_token(&proxy, 0, 2, token).unwrap();
    assert_eq!(c.get("k", SEC5).unwrap(), b"v");
    c.barrier("b", SEC5).unwrap();
    c.shutdown(SEC5).unwrap();
    other.join().unwrap();
    // A wrong guess goes through the proxy too.
    assert!(with_token(&proxy, 1, 2, "a-guess").is_err());
    let seen = seen.lock().unwrap().clone();
    // The capture is real: it holds the handshakes and the key.
    assert!(seen.windows(4).filter(|w| *w == MAGIC).count() >= 4);
    assert!(seen.windows(1).any(|w| w == b"k"));
    for needle in [
        token.as_bytes(),
        &token.as_bytes()[..12],
        &token.as_bytes()[12..],
    ] {
        assert!(
            !seen.windows(needle.len()).any(|w| w == needle),
            "the token (or part of it) went over the wire"
        );
    }
}

#[test]
fn the_store_caps_its_total_bytes() {
    assert_eq!(MAX_STORED_BYTES, 256 << 20);
    let options = ServerOptions {
        max_stored_bytes: 1000,
        ..ServerOptions::default()
    };
    let server = KvServer::start_with("127.0.0.1:0".parse().unwrap(), 1, options).unwrap();
    let addr = server.local_addr().to_string();
    let c = KvClient::connect(&addr, 0, 1, SEC5).unwrap();
    c.set("a", &[1; 599]).unwrap(); // 600 bytes with its key
    let err = c.set("b", &[2; 599]).unwrap_err();
    assert!(
        matches!(
            err,
            KvError::Full {
                bytes: 600,
                stored: 600,
                limit: 1000,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "cannot store key `b` (600 B): the rendezvous already holds 600 B of at most 1000 B"
    );
    assert_eq!(c.try_get("b").unwrap(), None);
    // Overwriting counts the new value in place of the old one.
    c.set("a", &[3; 99]).unwrap();
    c.set("b", &[2; 599]).unwrap();
    c.set("b", &[2; 999]).unwrap_err();
    assert_eq!(c.get("b", SEC5).unwrap(), vec![2; 599]);
    // The service goes on after a refusal.
    c.barrier("after", SEC5).unwrap();
}

#[test]
fn a_process_count_mismatch_fails_every_process_at_once() {
    let (_server, addr) = server(2);
    let p0 = Arc::new(KvClient::connect(&addr, 0, 2, SEC5).unwrap());
    let start = Instant::now();
    let joined = {
        let p0 = Arc::clone(&p0);
        thread::spawn(move || p0.barrier("join", Duration::from_secs(30)))
    };
    thread::sleep(Duration::from_millis(100));
    let err = KvClient::connect(&addr, 1, 3, SEC5).unwrap_err();
    let want = "process 1 was started for 3 processes but process 0 runs 2; start every process with the same count";
    assert_eq!(err.to_string(), want);
    // Process 0's wait ends at once too, naming both counts, well within
    // its 30 s.
    let err = joined.join().unwrap().unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(err.to_string(), want);
    // So does anything it waits for afterwards.
    assert!(matches!(
        p0.get("k", Duration::from_secs(30)),
        Err(KvError::CountMismatch { .. })
    ));
    assert!(matches!(p0.watch(), Err(KvError::CountMismatch { .. })));
}
