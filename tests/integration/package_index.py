#!/usr/bin/env python3
"""A PEP 503 "simple" package index on 127.0.0.1, for the `packages` tests.

It builds its own wheels (pure Python, py3-none-any) at start:
  esbtestdep 1.1                       module esbtestdep: VALUE = "dep 1.1"
  esbtestpkg 0.9 and 1.0               module esbtestpkg: hello(); 1.0 requires esbtestdep>=1.0,
                                       and its extra "fancy" requires esbtestextra
  esbtestextra 1.0                     module esbtestextra: VALUE = "extra 1.0"
and serves /simple/<name>/ (links with #sha256=) and /files/<wheel>. GET /_requests answers the
list of paths requested so far (JSON), so a test can prove that a second install made no
request. Prints "PORT <n>" on stdout once listening; runs until killed. An optional argument
is the port to listen on (a restarted index keeps its address).
"""
import base64
import hashlib
import http.server
import io
import json
import sys
import threading
import zipfile


def build_wheel(name, version, modules, requires=(), extras=None):
    dist = "%s-%s" % (name, version)
    files = dict(modules)
    files[dist + ".dist-info/METADATA"] = (
        "Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)
        + "".join("Requires-Dist: %s\n" % r for r in requires)
        + "".join("Provides-Extra: %s\n" % e + "".join(
            'Requires-Dist: %s; extra == "%s"\n' % (r, e) for r in reqs)
            for e, reqs in (extras or {}).items()))
    files[dist + ".dist-info/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: esb-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (path, digest, len(data)))
    record.append(dist + ".dist-info/RECORD,,")
    files[dist + ".dist-info/RECORD"] = "\n".join(record) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path, text in files.items():
            z.writestr(path, text)
    return "%s-py3-none-any.whl" % dist, buf.getvalue()


WHEELS = {}  # project -> {filename: bytes}


def add(project, filename_data):
    filename, data = filename_data
    WHEELS.setdefault(project, {})[filename] = data


add("esbtestdep", build_wheel("esbtestdep", "1.1", {"esbtestdep/__init__.py": 'VALUE = "dep 1.1"\n'}))
add("esbtestpkg", build_wheel("esbtestpkg", "0.9", {
    "esbtestpkg/__init__.py": 'def hello():\n    return "hello from esbtestpkg 0.9"\n'}))
add("esbtestpkg", build_wheel("esbtestpkg", "1.0", {
    "esbtestpkg/__init__.py": ('from esbtestdep import VALUE\n\n\ndef hello():\n'
                               '    return "hello from esbtestpkg 1.0 with " + VALUE\n')},
    requires=["esbtestdep>=1.0"], extras={"fancy": ["esbtestextra"]}))
add("esbtestextra", build_wheel("esbtestextra", "1.0",
                                {"esbtestextra/__init__.py": 'VALUE = "extra 1.0"\n'}))

REQUESTS = []
LOCK = threading.Lock()


def serve(path):
    """Answers a GET of `path` (query stripped): (status, body, content type). Also used by
    egress/upstream.py, which serves the same index over HTTPS."""
    if path == "/_requests":
        with LOCK:
            return 200, json.dumps(REQUESTS).encode(), "application/json"
    with LOCK:
        REQUESTS.append(path)
    parts = [p for p in path.split("/") if p]
    if len(parts) == 2 and parts[0] == "simple" and parts[1] in WHEELS:
        links = "".join(
            '<a href="/files/%s#sha256=%s">%s</a><br>\n'
            % (fn, hashlib.sha256(data).hexdigest(), fn)
            for fn, data in sorted(WHEELS[parts[1]].items()))
        page = "<!DOCTYPE html><html><body>\n%s</body></html>\n" % links
        return 200, page.encode(), "text/html"
    if len(parts) == 2 and parts[0] == "files":
        for files in WHEELS.values():
            if parts[1] in files:
                return 200, files[parts[1]], "application/octet-stream"
    return 404, b"not found\n", "text/plain"


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        code, body, ctype = serve(self.path.split("?")[0])
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    sys.stdout.write("PORT %d\n" % server.server_address[1])
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
