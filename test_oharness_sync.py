"""Tests for oharness_sync, in the order of the module's sections.

Run: python3 -m unittest -v test_oharness_sync

Wire-level cases start a real server on port 0 (in a thread, or as a
subprocess where a crash or a signal is part of the test).
"""

import errno
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

import oharness_sync as sync

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = os.path.join(HERE, "oharness_sync.py")
TESTDATA = os.path.join(HERE, "testdata")


def record(session="s1", record_id="r1", seq=1, device="laptop", at=1789344000000, body=None):
    """A well-formed record for a push."""
    return {"session": session, "id": record_id, "seq": seq, "device": device, "at": at,
            "body": {"role": "user", "content": "hello"} if body is None else body}


def meta(session_id="s1", gen=0, updated_at=1789344000000, **extra):
    """Well-formed session metadata for a push."""
    entry = {"id": session_id, "gen": gen, "updatedAt": updated_at}
    entry.update(extra)
    return entry


class Answer:
    """A parsed HTTP answer: status, headers (lower-case names) and the JSON body."""

    def __init__(self, status, headers, raw):
        self.status = status
        self.headers = headers
        self.raw = raw
        self.json = json.loads(raw.decode("utf-8")) if raw else None

    def __repr__(self):
        return "Answer(%d, %r)" % (self.status, self.raw[:200])


def http_request(url, method, path, body=None, token=None, headers=None, timeout=10):
    """One request on a fresh connection; body may be bytes or a JSON value."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["Authorization"] = "Bearer " + token
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode("utf-8")
            all_headers.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=all_headers)
        response = conn.getresponse()
        raw = response.read()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, raw)
    finally:
        conn.close()


class ServerCase(unittest.TestCase):
    """A real server on port 0 in this process, on a fresh data dir, with tokens for alice and bob."""

    server_options = {}

    def setUp(self):
        self.data_dir = tempfile.mkdtemp(prefix="ohs-test-")
        self.addCleanup(shutil.rmtree, self.data_dir, True)
        self.tokens = sync.TokenStore(self.data_dir)
        self.alice = self.issue("alice", ["platform"])
        self.bob = self.issue("bob")
        self.start_server()

    def start_server(self):
        self.log_lines = []
        self.server = sync.build_server(self.data_dir, port=0, log=CapturingLog(self.log_lines),
                                        **self.server_options)
        self.url = self.server.url
        thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        self.addCleanup(self.stop_server, self.server, thread)

    @staticmethod
    def stop_server(server, thread):
        server.stopping.set()
        server.app.feeds.stop()
        server.shutdown()
        server.server_close()
        thread.join(5)

    def issue(self, principal, teams=(), **options):
        token, _ = self.tokens.issue(principal, teams, **options)
        return token

    def request(self, method, path, body=None, token=None, headers=None, timeout=10):
        return http_request(self.url, method, path, body, token, headers, timeout)

    def push(self, token, project="proj", records=(), sessions=(), team=None, **extra):
        body = {"project": project, "records": list(records), "sessions": list(sessions)}
        if team is not None:
            body["team"] = team
        body.update(extra)
        return self.request("POST", "/v1/push", body, token)

    def pull(self, token, project="proj", since=0, **params):
        query = "project=%s&since=%s" % (project, since)
        for name, value in params.items():
            query += "&%s=%s" % (name, value)
        return self.request("GET", "/v1/pull?" + query, token=token, timeout=40)

    def assertAnswer(self, answer, status, body=None):
        self.assertEqual(answer.status, status, answer.raw)
        self.assertEqual(answer.headers.get("content-type"), "application/json")
        self.assertEqual(int(answer.headers["content-length"]), len(answer.raw))
        if body is not None:
            self.assertEqual(answer.json, body)

    def feed_files(self):
        found = []
        for root, _, files in os.walk(os.path.join(self.data_dir, "feeds")):
            found.extend(os.path.join(root, name) for name in files)
        return sorted(found)


class CapturingLog(sync.Log):
    """A Log that keeps its lines in a list instead of writing them."""

    def __init__(self, lines):
        super().__init__(quiet=False)
        self.lines = lines

    def __call__(self, message):
        self.lines.append(message)


class SubprocessServer:
    """The server as a child process (for signals, crashes and the command line)."""

    def __init__(self, data_dir, *flags):
        self.process = subprocess.Popen(
            [sys.executable, MODULE, "--data", data_dir, "--port", "0", "--quiet"] + list(flags),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.process.stdout.readline().decode()
        if not line.startswith("oharness-sync listening on "):
            self.process.kill()
            raise AssertionError("server did not start: %r %r" % (line, self.process.stderr.read()))
        self.url = line.split()[-1]

    def stop(self, signum=signal.SIGTERM, timeout=15):
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        stderr = self.process.stderr.read().decode()
        self.process.stdout.close()
        self.process.stderr.close()
        return code, stderr


if __name__ == "__main__":
    unittest.main()
