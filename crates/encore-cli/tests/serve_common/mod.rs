//! `encore serve` on a loopback port over the default model on the CPU,
//! and a raw HTTP/1.1 client that can misbehave as a hostile one does.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A running `encore serve`, killed when dropped.
pub struct Server {
    pub child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Everything it wrote on stderr so far.
    pub log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `encore serve --device cpu --port 0 -c 1024 EXTRA` (`-c`
    /// only when `extra` lacks it) and waits until `/health` answers 200.
    pub fn start(extra: &[&str]) -> Server {
        let ctx: &[&str] = if extra.contains(&"-c") {
            &[]
        } else {
            &["-c", "1024"]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_encore"))
            .args(["serve", "--device", "cpu", "--port", "0"])
            .args(ctx)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let log = Arc::new(Mutex::new(String::new()));
        let addr = loop {
            let mut line = String::new();
            assert!(
                stderr.read_line(&mut line).unwrap() > 0,
                "the server exited early: {}",
                log.lock().unwrap()
            );
            log.lock().unwrap().push_str(&line);
            if let Some(rest) = line.split("listening on http://").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        let tail = log.clone();
        std::thread::spawn(move || {
            for line in stderr.lines() {
                let Ok(line) = line else { break };
                let mut log = tail.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let server = Server { child, addr, log };
        let started = Instant::now();
        while get(&server.addr, "/health").status != 200 {
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "not ready: {}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to end, at most `limit`.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < limit,
                "the server did not exit: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The value of a metric line `name` (with its labels) in `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        metric(&get(&self.addr, "/metrics").body, name)
    }

    /// Resident memory in KiB, from /proc.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    /// Open file descriptors, from /proc.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of the line `name VALUE` of a Prometheus text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// An HTTP response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {:?}", self.status, self.body))
    }

    /// Checks the body is an error in OpenAI's shape and returns it.
    pub fn error(&self) -> Value {
        assert!(
            self.header("content-type")
                .is_some_and(|t| t.starts_with("application/json")),
            "{self:?}"
        );
        let body = self.json();
        let error = body["error"].clone();
        assert!(error["message"].is_string(), "{self:?}");
        assert!(error["type"].is_string(), "{self:?}");
        assert!(error.get("param").is_some(), "{self:?}");
        assert!(error.get("code").is_some(), "{self:?}");
        error
    }

    /// The `data:` payloads of a server-sent-events body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
}

/// Opens a connection.
pub fn connect(addr: &str) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(300)))
        .unwrap();
    stream
}

/// The bytes of a request with `Connection: close`.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Reads a whole response from `stream` (until the server closes it).
pub fn read_reply(stream: &mut TcpStream) -> Reply {
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse(&raw)
}

/// Parses a response, undoing chunked transfer encoding.
pub fn parse(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {text:?}"));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
                break;
            };
            if n == 0 || after.len() < n {
                out.push_str(&after[..after.len().min(n)]);
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].strip_prefix("\r\n").unwrap_or(&after[n..]);
        }
        out
    } else {
        body.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

/// One request on a fresh connection.
pub fn send(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut stream = connect(addr);
    stream
        .write_all(&request_bytes(method, path, headers, body))
        .unwrap();
    read_reply(&mut stream)
}

pub fn get(addr: &str, path: &str) -> Reply {
    send(addr, "GET", path, &[], b"")
}

pub fn post(addr: &str, path: &str, body: &Value) -> Reply {
    send(addr, "POST", path, &[], body.to_string().as_bytes())
}

/// A chat request of `content` at temperature 0 with `extra` fields.
pub fn chat(content: &str, extra: Value) -> Value {
    let mut body = serde_json::json!({
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Sends `body` to the chat route and reads the response until its first
/// server-sent event (or its end), then returns the connection and what
/// was read.
pub fn start_stream(addr: &str, body: &Value) -> (TcpStream, Vec<u8>) {
    let mut stream = connect(addr);
    stream
        .write_all(&request_bytes(
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        ))
        .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("data: ") {
        let n = stream.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
    }
    (stream, raw)
}

/// Reads the rest of a stream begun by [`start_stream`].
pub fn finish_stream(mut stream: TcpStream, mut raw: Vec<u8>) -> Reply {
    let _ = stream.read_to_end(&mut raw);
    parse(&raw)
}

/// Whether the server closes `stream` within `limit` without sending more
/// than an error response.
pub fn closed_within(stream: &mut TcpStream, limit: Duration) -> (bool, String) {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut raw = Vec::new();
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return (true, String::from_utf8_lossy(&raw).into_owned()),
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (true, String::from_utf8_lossy(&raw).into_owned())
            }
            Err(_) => return (false, String::from_utf8_lossy(&raw).into_owned()),
        }
        if started.elapsed() > limit {
            return (false, String::from_utf8_lossy(&raw).into_owned());
        }
    }
}
