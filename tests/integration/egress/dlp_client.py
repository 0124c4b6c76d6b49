#!/usr/bin/env python3
"""Runs INSIDE a sandbox (egress_e2e_test): POSTs planted secrets through the environment's
proxy in every encoding the DLP must see through, over HTTP (absolute URI) and HTTPS
(CONNECT + TLS with the environment's CA, which the sandbox trusts), and prints one JSON line
per case: {"case", "status", "blocked" (X-Esb-Blocked), "body" (first 300 chars)}.

Usage: dlp_client.py HOST CASES_JSON   CASES_JSON = {"<case id>": "<text with the secret>"}
Each case id becomes the request path /<case id>-<encoding>-<http|tls>. Raw sockets, so
the chunk boundaries are the test's own: the "chunked" encoding splits the text in the
middle of the secret and sends the halves as two chunks in two writes 200 ms apart.
"""
import gzip
import json
import os
import socket
import ssl
import sys
import time
import urllib.parse

PROXY = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])


def encodings(text, secret_at):
    """(name, headers, body pieces) for `text`; secret_at is where the secret starts."""
    raw = text.encode()
    yield "plain", {"Content-Type": "text/plain"}, [raw]
    yield "gzip", {"Content-Type": "text/plain", "Content-Encoding": "gzip"}, [gzip.compress(raw)]
    escaped = "".join("\\u%04x" % ord(c) for c in text)  # every character JSON-escaped
    yield "json", {"Content-Type": "application/json"}, [('{"note": "%s"}' % escaped).encode()]
    encoded = "".join("%%%02X" % b for b in raw)  # every byte percent-encoded
    yield "urlencoded", {"Content-Type": "application/x-www-form-urlencoded"}, [
        ("note=" + encoded + "&x=1").encode()]
    boundary = "esbBoundary7MA4YWxkTrZu0gW"
    multipart = ("--%s\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nhello\r\n"
                 "--%s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"n.txt\"\r\n"
                 "Content-Type: text/plain\r\n\r\n%s\r\n--%s--\r\n"
                 % (boundary, boundary, text, boundary))
    yield "multipart", {"Content-Type": "multipart/form-data; boundary=" + boundary}, [
        multipart.encode()]
    cut = secret_at + 6  # inside the secret
    yield "chunked", {"Content-Type": "text/plain", "Transfer-Encoding": "chunked"}, [
        raw[:cut], raw[cut:]]


def request_bytes(target, host, headers, pieces):
    head = "POST %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n" % (target, host)
    for name, value in headers.items():
        head += "%s: %s\r\n" % (name, value)
    if headers.get("Transfer-Encoding") == "chunked":
        parts = [("%x\r\n" % len(p)).encode() + p + b"\r\n" for p in pieces] + [b"0\r\n\r\n"]
        return [head.encode() + b"\r\n"] + parts
    body = b"".join(pieces)
    return [(head + "Content-Length: %d\r\n\r\n" % len(body)).encode() + body]


def read_response(sock):
    data = b""
    sock.settimeout(20)
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "-1"))
    while length < 0 or len(rest) < length:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        rest += chunk
    return status, headers, rest


def send(sock, writes):
    for i, w in enumerate(writes):
        if i > 1:
            time.sleep(0.2)  # the chunks of a chunked body arrive in separate writes
        sock.sendall(w)


def over_http(host, path, headers, pieces):
    sock = socket.create_connection((PROXY.hostname, PROXY.port), timeout=20)
    try:
        send(sock, request_bytes("http://%s%s" % (host, path), host, headers, pieces))
        return read_response(sock)
    finally:
        sock.close()


def over_https(host, path, headers, pieces):
    sock = socket.create_connection((PROXY.hostname, PROXY.port), timeout=20)
    try:
        sock.sendall(("CONNECT %s:443 HTTP/1.1\r\nHost: %s:443\r\n\r\n" % (host, host)).encode())
        status, headers_in, body = read_response_head_only(sock)
        if status != 200:
            return status, headers_in, body
        tls = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        send(tls, request_bytes(path, host, headers, pieces))
        return read_response(tls)
    finally:
        sock.close()


def read_response_head_only(sock):
    """The CONNECT answer: its head (and a body only when it is not 200)."""
    data = b""
    sock.settimeout(20)
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    lines = data.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    body = b""
    if status != 200:
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return status, headers, body


def main():
    host = sys.argv[1]
    cases = json.loads(sys.argv[2])
    for case, (text, secret_at) in sorted(cases.items()):
        for enc, headers, pieces in encodings(text, secret_at):
            for scheme, fn in (("http", over_http), ("tls", over_https)):
                name = "%s-%s-%s" % (case, enc, scheme)
                try:
                    status, h, body = fn(host, "/" + name, headers, pieces)
                    out = {"case": name, "status": status, "blocked": h.get("x-esb-blocked", ""),
                           "body": body[:300].decode("utf-8", "replace")}
                except (OSError, ssl.SSLError, ValueError) as e:
                    out = {"case": name, "status": -1, "blocked": "", "body": repr(e)[:300]}
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
