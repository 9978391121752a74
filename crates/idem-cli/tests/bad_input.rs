//! Hostile requests, written byte for byte to a raw TCP socket (an HTTP client would refuse or
//! tidy most of them), against a real `idem serve`. Every row must get a 4xx with problem
//! details, never a 500; the database must hold no key and no payment afterwards; and the
//! server must answer and close the connection in bounded time.
//!
//! A bare `400` with no body is accepted only where hyper refuses the bytes before any of
//! idem's code runs ([`Expect::RefusedByHyper`]): NUL in a field value (RFC 9110 §5.5), DEL
//! (not a field-vchar), obs-fold (RFC 9112 §5.2), and the malformed "request" that the excess
//! of a body larger than declared turns into.

use std::time::Duration;

use crate::common::{ALICE, TestServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BODY: &[u8] = br#"{"amount": 49900, "currency": "INR"}"#;
const KEY: &[u8] = b"Idempotency-Key: \"bad-input-key-0001\"";
const JSON: &[u8] = b"Content-Type: application/json";

/// `BODY` gzip-compressed (python3: `gzip.compress(BODY, mtime=0)`).
const BODY_GZIP: &[u8] = &[
    0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x03, 0xab, 0x56, 0x4a, 0xcc, 0xcd, 0x2f,
    0xcd, 0x2b, 0x51, 0xb2, 0x52, 0x30, 0xb1, 0xb4, 0x34, 0x30, 0xd0, 0x51, 0x50, 0x4a, 0x2e, 0x2d,
    0x2a, 0x4a, 0xcd, 0x4b, 0xae, 0x04, 0x0a, 0x29, 0x79, 0xfa, 0x05, 0x29, 0xd5, 0x02, 0x00, 0x41,
    0x3d, 0x9f, 0xc1, 0x24, 0x00, 0x00, 0x00,
];

/// Past this the connection counts as hung. Every row is answered in well under a second; the
/// margin is for a loaded CI machine.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// What a row must get first on its connection.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Problem details from idem (the layer or the service): this status and `type`.
    Problem(u16, &'static str),
    /// hyper refused the bytes before idem's code ran: `400`, no body.
    RefusedByHyper,
}

const MALFORMED_KEY: Expect = Expect::Problem(400, "urn:idem:problem:malformed-key");
const MALFORMED_BODY: Expect = Expect::Problem(400, "urn:idem:problem:malformed-body");

/// A `POST /payments` from Alice with `lines` as its header fields and `body` (its length
/// declared), asking the server to close the connection after answering.
fn post(lines: &[&[u8]], body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST /payments HTTP/1.1\r\nHost: idem.test\r\nAuthorization: Bearer {ALICE}\r\n\
         Connection: close\r\nContent-Length: {}\r\n",
        body.len()
    )
    .into_bytes();
    for line in lines {
        request.extend_from_slice(line);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    request.extend_from_slice(body);
    request
}

/// A request whose only fault is its `Idempotency-Key` field value.
fn with_key(value: &[u8]) -> Vec<u8> {
    post(&[&[&b"Idempotency-Key: "[..], value].concat(), JSON], BODY)
}

/// A request with a valid key whose only fault is its JSON body.
fn with_body(body: &[u8]) -> Vec<u8> {
    post(&[KEY, JSON], body)
}

#[derive(Debug)]
struct RawResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Splits what the server sent into responses (framed by Content-Length, else to the end).
fn parse_responses(mut bytes: &[u8]) -> Vec<RawResponse> {
    let mut responses = Vec::new();
    while !bytes.is_empty() {
        let end = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("an incomplete response head: {:?}", lossy(bytes)));
        let head = std::str::from_utf8(&bytes[..end]).expect("an ASCII response head");
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap();
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("a bad status line {status_line:?}"));
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let rest = &bytes[end + 4..];
        let length = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map_or(rest.len(), |(_, v)| {
                v.parse().expect("a numeric Content-Length")
            });
        assert!(
            headers
                .iter()
                .all(|(n, _)| !n.eq_ignore_ascii_case("transfer-encoding")),
            "idem's responses all have a known length"
        );
        responses.push(RawResponse {
            status,
            headers,
            body: rest[..length].to_vec(),
        });
        bytes = &rest[length..];
    }
    responses
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned()
}

/// Writes `request` (then `trickle`, one byte every 100 ms, alongside) and reads until the
/// server closes the connection. A connection still open after [`ANSWER_WITHIN`] fails the row.
async fn exchange(server: &TestServer, request: &[u8], trickle: &'static [u8]) -> Vec<u8> {
    let addr = server.url.trim_start_matches("http://");
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    writer.write_all(request).await.expect("write the request");
    let trickler = tokio::spawn(async move {
        for byte in trickle {
            tokio::time::sleep(Duration::from_millis(100)).await;
            // The server may close first; that is the point of the row, not an error.
            if writer.write_all(&[*byte]).await.is_err() {
                break;
            }
        }
        // Keep the write half open: closing it would let the server see EOF, not slowness.
        std::future::pending::<()>().await;
    });
    let mut received = Vec::new();
    let read = tokio::time::timeout(ANSWER_WITHIN, async {
        let mut buf = [0; 8192];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => received.extend_from_slice(&buf[..n]),
                // A server that closes with our bytes unread resets the connection; what it
                // sent before is already in `received`.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("reading the answer failed: {e}"),
            }
        }
    })
    .await;
    trickler.abort();
    assert!(
        read.is_ok(),
        "the connection was still open after {ANSWER_WITHIN:?} (hung); received so far: {:?}",
        lossy(&received)
    );
    received
}

/// The problem details `response` carries (row `name`), with their content type.
fn problem_of(name: &str, response: &RawResponse) -> serde_json::Value {
    assert_eq!(
        response.header("content-type"),
        Some("application/problem+json"),
        "{name}: {response:?}"
    );
    serde_json::from_slice(&response.body).expect("problem details are JSON")
}

/// Runs one row against its own server and checks the answer and the database.
async fn row(
    name: &str,
    configure: impl FnOnce(&mut idem_cli::serve::ServeConfig),
    request: Vec<u8>,
    trickle: &'static [u8],
    expect: Expect,
) {
    let server = TestServer::start_with(configure).await;
    let received = exchange(&server, &request, trickle).await;
    let responses = parse_responses(&received);
    let first = responses
        .first()
        .unwrap_or_else(|| panic!("{name}: the connection closed without an answer"));
    match expect {
        Expect::Problem(status, kind) => {
            assert_eq!(first.status, status, "{name}: {first:?}");
            let problem = problem_of(name, first);
            assert_eq!(problem["type"], kind, "{name}: {problem}");
            assert_eq!(problem["status"], status, "{name}: {problem}");
        }
        Expect::RefusedByHyper => {
            assert_eq!(first.status, 400, "{name}: {first:?}");
            assert!(first.body.is_empty(), "{name}: {first:?}");
        }
    }
    // Whatever else came on the connection (a request smuggled after the first) is refused
    // too: a 4xx, with problem details when it has a body.
    for response in &responses {
        assert!(
            (400..500).contains(&response.status),
            "{name}: {response:?}"
        );
        if !response.body.is_empty() {
            let problem = problem_of(name, response);
            assert!(problem["type"].is_string(), "{name}: {problem}");
        }
    }
    assert_eq!(server.keys().await, 0, "{name}: a key record was stored");
    assert_eq!(server.payments().await, 0, "{name}: a payment was made");
    server.stop().await;
}

/// Rows that need nothing but the default configuration.
macro_rules! rows {
    ($($name:ident: $request:expr => $expect:expr;)*) => {$(
        #[tokio::test]
        async fn $name() {
            row(stringify!($name), |_| {}, $request, b"", $expect).await;
        }
    )*};
}

rows! {
    // The same key twice is still two fields: which one would be the key?
    two_key_fields:
        post(&[KEY, KEY, JSON], BODY) => MALFORMED_KEY;
    // Joined with ", " (RFC 9110 §5.3) the two halves read as one sf-string,
    // "bad-input-key, 0001"; the layer counts fields before it joins anything.
    field_split_into_halves_that_join_into_one_string:
        post(&[b"Idempotency-Key: \"bad-input-key", b"Idempotency-Key: 0001\"", JSON], BODY)
        => MALFORMED_KEY;
    // A key and an empty field: joined, a list whose empty member a lax parser drops.
    field_split_into_a_key_and_an_empty_part:
        post(&[b"Idempotency-Key: bad-input-key-0001", b"Idempotency-Key:", JSON], BODY)
        => MALFORMED_KEY;
    // obs-fold: a continuation line that would unfold into a list of two keys.
    field_folded_onto_a_continuation_line:
        post(&[b"Idempotency-Key: \"bad-input-key-0001\",\r\n \"bad-input-key-0002\"", JSON], BODY)
        => Expect::RefusedByHyper;
    obs_text_bytes_in_the_key:
        with_key(b"bad-input-\x80\xc3\xa9\xff-0001") => MALFORMED_KEY;
    nul_in_the_key:
        with_key(b"bad-input\x00key-0001") => Expect::RefusedByHyper;
    tab_inside_the_key:
        with_key(b"bad-input\tkey-0001") => MALFORMED_KEY;
    tab_inside_a_quoted_key:
        with_key(b"\"bad-input\tkey-0001\"") => MALFORMED_KEY;
    del_in_the_key:
        with_key(b"bad-input\x7fkey-0001") => Expect::RefusedByHyper;
    key_of_64_kib:
        with_key(&[b'k'; 64 * 1024]) => MALFORMED_KEY;
    quoted_key_of_64_kib:
        with_key(&[&b"\""[..], &[b'k'; 64 * 1024], b"\""].concat()) => MALFORMED_KEY;
    unterminated_quote:
        with_key(b"\"bad-input-key-0001") => MALFORMED_KEY;
    key_with_parameters:
        with_key(b"\"bad-input-key-0001\";expires=3600") => MALFORMED_KEY;
    integer_item_as_key:
        with_key(b"123") => MALFORMED_KEY;
    boolean_item_as_key:
        with_key(b"?1") => MALFORMED_KEY;
    byte_sequence_item_as_key:
        with_key(b":YWJj:") => MALFORMED_KEY;
    // Hidden in a field a payment would ignore, so only the depth limit can refuse it.
    json_nested_10000_deep:
        with_body(&[
            &br#"{"amount": 49900, "currency": "INR", "metadata": "#[..],
            &[b'['; 10_000],
            &[b']'; 10_000],
            b"}",
        ].concat()) => MALFORMED_BODY;
    nan_in_the_body:
        with_body(br#"{"amount": NaN, "currency": "INR"}"#) => MALFORMED_BODY;
    // serde_json would keep the last member and charge 49900: two readers, two amounts.
    duplicate_members:
        with_body(br#"{"amount": 1, "amount": 49900, "currency": "INR"}"#) => MALFORMED_BODY;
    byte_order_mark_before_the_body:
        with_body(&[&b"\xef\xbb\xbf"[..], BODY].concat()) => MALFORMED_BODY;
    // idem decodes no content coding: the fingerprint covers the bytes as sent, and these
    // bytes, labelled JSON, are not JSON. So the answer is 400 malformed-body, before any work
    // and unstored, and a client that resends plain JSON with the same key succeeds. (415 with
    // Accept-Encoding, RFC 9110 §15.5.16, would name the cause more exactly.)
    gzip_body:
        post(&[KEY, JSON, b"Content-Encoding: gzip"], BODY_GZIP) => MALFORMED_BODY;
}

/// The body arrives one byte every 100 ms, far slower than `body_timeout` allows.
#[tokio::test]
async fn body_that_trickles_in() {
    let mut request = post(&[KEY, JSON], BODY);
    request.truncate(request.len() - BODY.len() + 1);
    row(
        "body_that_trickles_in",
        |config| config.policy.body_timeout = Duration::from_millis(300),
        request,
        &BODY[1..],
        Expect::Problem(408, "urn:idem:problem:body-timeout"),
    )
    .await;
}

/// Content-Length says 20 bytes; 36 follow, then an empty line. The first request is the
/// truncated JSON (malformed); the rest arrives as the next request on the kept-alive
/// connection, which hyper refuses as malformed.
#[tokio::test]
async fn body_larger_than_declared() {
    let mut request = format!(
        "POST /payments HTTP/1.1\r\nHost: idem.test\r\nAuthorization: Bearer {ALICE}\r\n\
         Idempotency-Key: \"bad-input-key-0001\"\r\nContent-Type: application/json\r\n\
         Content-Length: 20\r\n\r\n"
    )
    .into_bytes();
    request.extend_from_slice(BODY);
    request.extend_from_slice(b"\r\n\r\n");
    row(
        "body_larger_than_declared",
        |_| {},
        request,
        b"",
        MALFORMED_BODY,
    )
    .await;
}

/// The control: the same raw path with nothing wrong stores one key and one payment, so an
/// empty database after the rows above means they were refused, not lost.
#[tokio::test]
async fn a_valid_request_on_the_same_path_is_stored() {
    let server = TestServer::start().await;
    let received = exchange(&server, &post(&[KEY, JSON], BODY), b"").await;
    let responses = parse_responses(&received);
    assert_eq!(responses.len(), 1, "{responses:?}");
    assert_eq!(responses[0].status, 201, "{:?}", responses[0]);
    assert_eq!(server.keys().await, 1);
    assert_eq!(server.payments().await, 1);
    server.stop().await;
}

/// A client that sends half a request head, or nothing, loses its connection after the head
/// deadline instead of holding it forever (a slowloris).
#[tokio::test]
async fn a_request_head_that_never_completes_is_closed() {
    let server = TestServer::start_with(|c| c.head_timeout = Duration::from_millis(500)).await;
    idem_testkit::assert_unfinished_heads_are_closed(
        server.url.trim_start_matches("http://"),
        "/payments",
    )
    .await;
    assert_eq!((server.keys().await, server.payments().await), (0, 0));
}

/// A client that writes its whole oversized body before it reads (as Python's `http.client`
/// does) still reads the `413`: the server drains the body instead of closing on it, which
/// would reset the connection under the client's writes. Declared and chunked, 2, 8 and
/// 64 MiB, on one connection each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_written_in_full_still_reads_the_413() {
    let server = TestServer::start().await;
    let addr = server.url.trim_start_matches("http://").to_owned();
    for mib in [2usize, 8, 64] {
        for chunked in [false, true] {
            let what = format!("{mib} MiB, chunked: {chunked}");
            let body = vec![b'x'; mib << 20];
            let framing = if chunked {
                "Transfer-Encoding: chunked".to_owned()
            } else {
                format!("Content-Length: {}", body.len())
            };
            let head = format!(
                "POST /payments HTTP/1.1\r\nHost: idem.test\r\nAuthorization: Bearer {ALICE}\r\n\
                 Idempotency-Key: \"oversized-key-{mib}-{chunked}\"\r\n\
                 Content-Type: application/json\r\n{framing}\r\n\r\n"
            );
            let stream = TcpStream::connect(&addr).await.unwrap();
            let (mut reader, mut writer) = stream.into_split();
            let written = tokio::spawn(async move {
                writer.write_all(head.as_bytes()).await?;
                if chunked {
                    for chunk in body.chunks(1 << 16) {
                        writer
                            .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                            .await?;
                        writer.write_all(chunk).await?;
                        writer.write_all(b"\r\n").await?;
                    }
                    writer.write_all(b"0\r\n\r\n").await?;
                } else {
                    writer.write_all(&body).await?;
                }
                std::io::Result::Ok(writer)
            });
            // Everything is written before anything is read, as the client above does.
            let _writer = tokio::time::timeout(ANSWER_WITHIN, written)
                .await
                .unwrap_or_else(|_| panic!("{what}: the body was not taken in time"))
                .unwrap()
                .unwrap_or_else(|e| panic!("{what}: writing the body failed: {e}"));
            let mut head = vec![0; 12];
            tokio::time::timeout(ANSWER_WITHIN, reader.read_exact(&mut head))
                .await
                .unwrap_or_else(|_| panic!("{what}: no answer"))
                .unwrap_or_else(|e| panic!("{what}: reading the answer failed: {e}"));
            assert_eq!(&head, b"HTTP/1.1 413", "{what}");
        }
    }
    assert_eq!((server.keys().await, server.payments().await), (0, 0));
    server.stop().await;
}
