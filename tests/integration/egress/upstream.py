#!/usr/bin/env python3
"""The "internet" of the egress tests: one local upstream on 127.0.0.1 (standard library only).

Usage: upstream.py DIR [--names a.test,b.test,...]

One port serves HTTP and HTTPS alike (a connection whose first byte is a TLS handshake record
is wrapped in TLS), so `--egress-resolve NAME=127.0.0.1:PORT` can send every test name here:
  /<repo>.git/...          a git smart-HTTP server: `git http-backend` as CGI over the bare
                           repositories the test creates under DIR/git/
  /simple/..., /files/...  the PEP 503 index of ../package_index.py (wheels it builds itself)
  /redirect?to=URL&code=N  answers N (default 302) with Location: URL
  anything else            the echo: 200 with a JSON summary of the request (method, path,
                           host, tls, sni, headers, body_len, body_sha256)

Certificates (made with the openssl CLI at first start, kept in DIR): a test root CA
(DIR/root.pem; give it to esbd as --egress-upstream-ca, or to a client as its CA file) and
one leaf for every name in --names plus localhost and 127.0.0.1.

Records, so a test can prove what arrived and what did not:
  DIR/received.bin   every byte received on every connection (after TLS decryption), appended
  DIR/requests.jsonl one JSON line per request (method, path, host, tls, sni, body_len, status)

Prints "PORT <n>" on stdout once listening; runs until killed.
"""
import argparse
import hashlib
import http.server
import json
import os
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import package_index  # noqa: E402  (the same index the packages tests use)

DEFAULT_NAMES = "git.test,pypi.test,echo.test,api.echo.test,weather.example,evil.test"
MAX_BODY = 64 << 20
RECORD_LOCK = threading.Lock()


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=60)


def make_certs(directory, names):
    """A P-256 test root (CA:TRUE) and a leaf for `names` signed by it."""
    if not os.path.exists(os.path.join(directory, "root.pem")):
        openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "root.key",
                cwd=directory)
        openssl("req", "-x509", "-new", "-key", "root.key", "-subj", "/CN=esb egress test root",
                "-days", "3", "-out", "root.pem",
                "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                "-addext", "subjectKeyIdentifier=hash", cwd=directory)
    san = ",".join(["DNS:" + n for n in names] + ["DNS:localhost", "IP:127.0.0.1"])
    with open(os.path.join(directory, "leaf.ext"), "w") as f:
        f.write("basicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature\n"
                "extendedKeyUsage=serverAuth\n"
                "subjectKeyIdentifier=hash\n"
                "authorityKeyIdentifier=keyid,issuer\n"
                "subjectAltName=" + san + "\n")
    openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "leaf.key",
            cwd=directory)
    openssl("req", "-new", "-key", "leaf.key", "-subj", "/CN=" + names[0], "-out", "leaf.csr",
            cwd=directory)
    openssl("x509", "-req", "-in", "leaf.csr", "-CA", "root.pem", "-CAkey", "root.key",
            "-CAcreateserial", "-days", "2", "-extfile", "leaf.ext", "-out", "leaf.pem",
            cwd=directory)


class Recorder:
    """Appends every byte read from a connection to DIR/received.bin."""

    def __init__(self, path):
        self.file = open(path, "ab", buffering=0)

    def write(self, data):
        if data:
            with RECORD_LOCK:
                self.file.write(data)


class TeeReader:
    """A read-side file object that records what it returns."""

    def __init__(self, inner, recorder):
        self.inner = inner
        self.recorder = recorder

    def read(self, n=-1):
        data = self.inner.read(n)
        self.recorder.write(data)
        return data

    def readline(self, limit=-1):
        data = self.inner.readline(limit)
        self.recorder.write(data)
        return data

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "esb-test-upstream"

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        self.rfile = TeeReader(self.rfile, self.server.recorder)

    # -- request body (Content-Length or chunked), bounded
    def read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return body
                if len(body) + size > MAX_BODY:
                    raise ValueError("body too large")
                body += self.rfile.read(size)
                self.rfile.readline(1024)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ValueError("body too large")
        return self.rfile.read(length) if length > 0 else b""

    def answer(self, code, body, headers=()):
        self.send_response(code)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def note(self, body, status):
        line = {"method": self.command, "path": self.path, "host": self.headers.get("Host", ""),
                "tls": self.server_tls, "sni": self.server_sni, "body_len": len(body),
                "status": status}
        with RECORD_LOCK:
            with open(self.server.requests_path, "a") as f:
                f.write(json.dumps(line) + "\n")

    def handle_any(self):
        try:
            body = self.read_body()
        except ValueError as e:
            self.close_connection = True
            return self.answer(400, (str(e) + "\n").encode(), [("Content-Type", "text/plain")])
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        first = path.lstrip("/").split("/")[0]
        if first.endswith(".git") and "/" in path.lstrip("/"):
            status = self.git(url, body)
        elif path.startswith("/simple/") or path.startswith("/files/"):
            code, data, ctype = package_index.serve(path)
            self.answer(code, data, [("Content-Type", ctype)])
            status = code
        elif path == "/redirect":
            query = urllib.parse.parse_qs(url.query)
            status = int(query.get("code", ["302"])[0])
            self.answer(status, b"", [("Location", query.get("to", ["/"])[0])])
        else:
            status = 200
            summary = {"method": self.command, "path": self.path,
                       "host": self.headers.get("Host", ""), "tls": self.server_tls,
                       "sni": self.server_sni, "headers": [[k, v] for k, v in self.headers.items()],
                       "body_len": len(body), "body_sha256": hashlib.sha256(body).hexdigest()}
            self.answer(200, json.dumps(summary).encode(), [("Content-Type", "application/json")])
        self.note(body, status)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = handle_any

    def git(self, url, body):
        """git http-backend as CGI (smart HTTP; clone and fetch only: receive-pack needs
        REMOTE_USER, which is never set)."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "GIT_PROJECT_ROOT": self.server.git_root, "GIT_HTTP_EXPORT_ALL": "1",
               "REQUEST_METHOD": self.command, "PATH_INFO": urllib.parse.unquote(url.path),
               "QUERY_STRING": url.query, "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_ADDR": "127.0.0.1",
               "SERVER_PROTOCOL": "HTTP/1.1"}
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        try:
            out = subprocess.run(["git", "http-backend"], input=body, env=env,
                                 capture_output=True, timeout=30).stdout
        except subprocess.TimeoutExpired:
            out = b"Status: 504 Gateway Timeout\r\n\r\n"
        head, data = b"Status: 502 Bad Gateway", b""
        for sep in (b"\r\n\r\n", b"\n\n"):
            if sep in out:
                head, data = out.split(sep, 1)
                break
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name.strip(), value.strip()))
        self.answer(status, data, headers)
        return status


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def finish_request(self, request, client_address):
        # Runs in the connection's own thread: a slow handshake never stalls accept().
        request.settimeout(30)
        tls, sni = False, None
        try:
            first = request.recv(1, socket.MSG_PEEK)
            if first == b"\x16":
                seen = {}
                ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                ctx.load_cert_chain(self.leaf_pem, self.leaf_key)
                ctx.sni_callback = lambda sock, name, _ctx: seen.__setitem__("sni", name)
                request = ctx.wrap_socket(request, server_side=True)
                tls, sni = True, seen.get("sni")
        except (OSError, ssl.SSLError):
            return
        handler = type("BoundHandler", (Handler,), {"server_tls": tls, "server_sni": sni})
        try:
            handler(request, client_address, self)
        except (OSError, ssl.SSLError):
            pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--names", default=DEFAULT_NAMES)
    args = parser.parse_args()
    directory = os.path.abspath(args.dir)
    os.makedirs(os.path.join(directory, "git"), exist_ok=True)
    make_certs(directory, [n for n in args.names.split(",") if n])
    server = Server(("127.0.0.1", 0), Handler)
    server.leaf_pem = os.path.join(directory, "leaf.pem")
    server.leaf_key = os.path.join(directory, "leaf.key")
    server.git_root = os.path.join(directory, "git")
    server.recorder = Recorder(os.path.join(directory, "received.bin"))
    server.requests_path = os.path.join(directory, "requests.jsonl")
    sys.stdout.write("PORT %d\n" % server.server_address[1])
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
