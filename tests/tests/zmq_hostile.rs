//! ZMQ sources that fail or misbehave never take the sidecar down: an endpoint that does not
//! resolve, a listener that resets every handshake, a peer announcing a 2^45-byte frame. Hints
//! keep being served, `/debug/sources` and the metrics say what is wrong, and a source whose
//! endpoint appears later connects and indexes.

mod common;

use std::io::Write as _;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{hint_for_tokens, metric, spawn_sidecar, spawn_vllm_publisher};
use kvroute_harness::client::get_text;
use kvroute_harness::paths;
use kvroute_harness::process::{free_port, wait_for};
use kvroute_protocol::vllm::{decode_batch, VllmEvent};

/// The ZMTP 3.0 greeting of a NULL-mechanism client (64 bytes).
fn greeting() -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 0];
    let mut mechanism = b"NULL".to_vec();
    mechanism.resize(20, 0);
    g.extend(mechanism);
    g.push(0); // as-server
    g.resize(64, 0);
    g
}

/// Accept connections on `listener` and reset each at once (SO_LINGER 0), until `stop`.
fn resetting(listener: TcpListener, stop: Arc<AtomicBool>, resets: Arc<AtomicUsize>) {
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = socket_linger_zero(&stream);
                drop(stream);
                resets.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Closing a socket with SO_LINGER 0 sends RST instead of FIN.
fn socket_linger_zero(stream: &TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Linger {
        l_onoff: i32,
        l_linger: i32,
    }
    let linger = Linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket fd and a correctly sized `struct linger`.
    let rc = unsafe {
        libc_setsockopt(
            stream.as_raw_fd(),
            1,  /* SOL_SOCKET */
            13, /* SO_LINGER */
            &linger as *const Linger as *const std::ffi::c_void,
            std::mem::size_of::<Linger>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

extern "C" {
    #[link_name = "setsockopt"]
    fn libc_setsockopt(
        fd: i32,
        level: i32,
        name: i32,
        value: *const std::ffi::c_void,
        len: u32,
    ) -> i32;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_and_hostile_zmq_sources_leave_the_sidecar_serving() {
    let raw = kvroute_protocol::samples_dir().join("vllm/run1-sha256-default/raw");
    let dir = paths::run_dir("zmq-hostile").unwrap();
    let (late_port, replay_port, bound_port, port) = (
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
        free_port().unwrap(),
    );
    // The late endpoint resets every handshake until a real publisher takes its port.
    let listener = TcpListener::bind(("127.0.0.1", late_port)).unwrap();
    let (stop, resets) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let resetter = {
        let (stop, resets) = (stop.clone(), resets.clone());
        std::thread::spawn(move || resetting(listener, stop, resets))
    };
    let config = format!(
        "listen = \"127.0.0.1:{port}\"\n[[models]]\nname = \"m\"\ndir = \"{}\"\nblock_size = 32\n\
         [[workers]]\naddress = \"127.0.0.1:9000\"\nmodel = \"m\"\n\
         [[workers]]\naddress = \"127.0.0.1:9001\"\nmodel = \"m\"\n\
         [[zmq]]\nendpoint = \"tcp://kvroute-no-such-host.invalid:5557\"\nworker = \"127.0.0.1:9001\"\n\
         [[zmq]]\nendpoint = \"tcp://127.0.0.1:{bound_port}\"\nbind = true\nworker = \"127.0.0.1:9001\"\n\
         [[zmq]]\nendpoint = \"tcp://127.0.0.1:{late_port}\"\nreplay_endpoint = \"tcp://127.0.0.1:{replay_port}\"\nworker = \"127.0.0.1:9000\"\ntopic = \"kv-events\"\n",
        paths::model_dir().display()
    );
    let mut sidecar = spawn_sidecar(&dir, &config);
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let (http_ref, base_ref) = (&http, &base);
    wait_for("sidecar up", Duration::from_secs(20), || async move {
        let r = http_ref
            .get(format!("{base_ref}/healthz"))
            .send()
            .await
            .ok()?;
        r.status().is_success().then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));

    // A peer on the bound socket announces a 2^45-byte frame right after its greeting.
    let bound = ("127.0.0.1", bound_port);
    let mut peer = wait_for("the bound socket", Duration::from_secs(10), || async move {
        TcpStream::connect(bound).ok()
    })
    .await
    .unwrap();
    peer.write_all(&greeting()).unwrap();
    let mut frame = vec![0x06]; // a long command frame
    frame.extend((1u64 << 45).to_be_bytes());
    let _ = peer.write_all(&frame);
    let _ = peer.write_all(&[0u8; 4096]);
    std::thread::sleep(Duration::from_millis(300));
    drop(peer);

    // Still serving: hints, metrics, every source listed with what it is doing.
    let resets_ref = &resets;
    wait_for("a few resets", Duration::from_secs(10), || async move {
        (resets_ref.load(Ordering::Relaxed) >= 2).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));
    let cold = hint_for_tokens(&http, &base, &(0..64).collect::<Vec<u32>>(), 32).await;
    assert!(!cold.workers.is_empty(), "a cold prompt is still hinted");
    let sources = kvroute_harness::client::get_json(&http, &format!("{base}/debug/sources")).await;
    assert_eq!(sources.as_array().unwrap().len(), 3, "{sources}");
    let unresolvable = sources
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"].as_str().unwrap_or("").contains("no-such-host"))
        .unwrap_or_else(|| panic!("{sources}"));
    assert_ne!(unresolvable["state"], "receiving", "{sources}");
    assert!(
        unresolvable["last_error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "says why: {sources}"
    );

    // The late endpoint appears: the sidecar connects and indexes what it publishes.
    stop.store(true, Ordering::Relaxed);
    resetter.join().unwrap();
    let (late_arg, replay_arg) = (late_port.to_string(), replay_port.to_string());
    let _publisher = spawn_vllm_publisher(
        &dir,
        &raw,
        &["--pub-port", &late_arg, "--replay-port", &replay_arg],
    );
    let metrics_url = format!("{base}/metrics");
    let metrics_ref = &metrics_url;
    let text = wait_for(
        "the late publisher indexed",
        Duration::from_secs(30),
        || async move {
            let text = get_text(http_ref, metrics_ref).await?;
            (metric(&text, "kvroute_index_blocks{worker=\"127.0.0.1:9000\"}")? > 0.0)
                .then_some(text)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", sidecar.log_tail()));
    assert!(
        metric(&text, "kvroute_source_errors_total{source=\"zmq\"}").unwrap_or(0.0) >= 1.0,
        "the failing source is counted: {text}"
    );
    let payload = std::fs::read(raw.join("seq000000.payload.msgpack")).unwrap();
    let batch = decode_batch(&payload).unwrap();
    let VllmEvent::BlockStored { token_ids, .. } = &batch.events[0] else {
        panic!("the first capture is a store")
    };
    let warm = hint_for_tokens(&http, &base, token_ids, 32).await;
    assert_eq!(warm.workers[0], "127.0.0.1:9000");
    assert_eq!(warm.matched_blocks, 12);
    assert!(sidecar.is_running(), "{}", sidecar.log_tail());
}
