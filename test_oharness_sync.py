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
        """A new token, honoured at once (a running server otherwise looks once a second)."""
        token, _ = self.tokens.issue(principal, teams, **options)
        if hasattr(self, "server"):
            self.server.app.auth.local._checked = float("-inf")
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



# ---------------------------------------------------------------------------
# Validation and encoding
# ---------------------------------------------------------------------------

class IdAndNumberRulesTest(unittest.TestCase):
    def test_valid_ids(self):
        for value in ("a", "A-z_0", "x" * 128, "Proto__"):
            self.assertTrue(sync.is_valid_id(value), value)

    def test_invalid_ids(self):
        for value in ("", "x" * 129, "a/b", "a.b", "é", "a b", "a\n", "__proto__", "constructor", "prototype",
                      None, 5, ["a"]):
            self.assertFalse(sync.is_valid_id(value), repr(value))

    def test_safe_integers(self):
        self.assertEqual(sync.as_safe_int(0), 0)
        self.assertEqual(sync.as_safe_int(12.0), 12)
        self.assertEqual(sync.as_safe_int(2 ** 53 - 1), 2 ** 53 - 1)
        for value in (-1, 2 ** 53, 1.5, True, False, None, "1", float("inf"), float("nan")):
            self.assertIsNone(sync.as_safe_int(value), repr(value))

    def test_metadata_last_writer_wins(self):
        self.assertTrue(sync.metadata_wins((0, 5), None))
        self.assertTrue(sync.metadata_wins((1, 0), (0, 99)))      # higher gen wins
        self.assertTrue(sync.metadata_wins((1, 6), (1, 5)))       # same gen, later updatedAt wins
        self.assertFalse(sync.metadata_wins((1, 5), (1, 5)))      # equal adds nothing
        self.assertFalse(sync.metadata_wins((0, 99), (1, 0)))     # older gen loses


class JsonCodecTest(unittest.TestCase):
    def test_decode_refuses_what_is_not_strict_json(self):
        for data in (b"{", b"NaN", b'{"a":NaN}', b'{"a":Infinity}', b'[-Infinity]', b"[1e400]",
                     b'"\xff"', b"\xef\xbb\xbf{}", b"[" * 100000 + b"]" * 100000, b""):
            with self.assertRaises(ValueError, msg=data[:20]):
                sync.decode_json(data)

    def test_decode_accepts_depth_up_to_the_limit(self):
        depth = sync.MAX_JSON_DEPTH
        self.assertEqual(sync.decode_json(b"[" * depth + b"]" * depth), eval("[" * depth + "]" * depth))
        with self.assertRaises(ValueError):
            sync.decode_json(b"[" * (depth + 1) + b"]" * (depth + 1))

    def test_brackets_inside_strings_do_not_count_as_depth(self):
        text = '["' + "[" * 5000 + '\\"[", "\\\\"]'
        self.assertEqual(sync.decode_json(text.encode()), ["[" * 5000 + '"[', "\\"])

    def test_encode_writes_lone_surrogates_as_escapes(self):
        self.assertEqual(sync.encode_json(["\ud800", "é"]), b'["\\ud800","\\u00e9"]')
        self.assertEqual(sync.encode_json(["é", "😀"]), '["é","😀"]'.encode("utf-8"))


class QueryValueTest(unittest.TestCase):
    def test_cursor(self):
        self.assertEqual(sync.parse_cursor(None), 0)
        self.assertEqual(sync.parse_cursor("42"), 42)
        self.assertEqual(sync.parse_cursor(str(2 ** 53 - 1)), 2 ** 53 - 1)
        for text in ("-1", "1.5", "abc", "", " 1", str(2 ** 53), "9" * 40):
            with self.assertRaises(sync.ApiError, msg=text) as caught:
                sync.parse_cursor(text)
            self.assertEqual(caught.exception.status, 400)

    def test_clamped(self):
        self.assertEqual(sync.parse_clamped(None, "limit", 1, 500, 500), 500)
        self.assertEqual(sync.parse_clamped("0", "limit", 1, 500, 500), 1)
        self.assertEqual(sync.parse_clamped("-7", "limit", 1, 500, 500), 1)
        self.assertEqual(sync.parse_clamped("9" * 40, "limit", 1, 500, 500), 500)
        self.assertEqual(sync.parse_clamped("-" + "9" * 40, "wait", 0, 30, 0), 0)
        for text in ("1.5", "abc", ""):
            with self.assertRaises(sync.ApiError):
                sync.parse_clamped(text, "limit", 1, 500, 500)


class FileNameTest(unittest.TestCase):
    def test_names_are_reversible_and_differ_by_case_on_caseless_disks(self):
        for value in ("alice", "Alice", "ALICE", "a_b", "A__B", "_", "-x-", "Z9_z"):
            name = sync.encode_name(value)
            self.assertEqual(sync.decode_name(name), value)
            self.assertRegex(name, r"^[a-z0-9_-]+$")
        self.assertNotEqual(sync.encode_name("Alice").lower(), sync.encode_name("alice").lower())
        self.assertNotEqual(sync.encode_name("a_b"), sync.encode_name("aB"))


class PushValidationUnitTest(unittest.TestCase):
    def test_canonical_record_keeps_exactly_the_protocol_fields(self):
        push = sync.validate_push({"project": "p", "device": "ignored", "extra": 1,
                                   "records": [dict(record(seq=12.0), extra="dropped")]})
        self.assertEqual(json.loads(push.records[0].event),
                         {"session": "s1", "id": "r1", "seq": 12, "device": "laptop", "at": 1789344000000,
                          "body": {"role": "user", "content": "hello"}})

    def test_record_key_separates_session_and_id(self):
        self.assertNotEqual(sync.record_key("a\x00", "b"), sync.record_key("a", "\x00b"))
        self.assertEqual(sync.record_key("s", "r"), sync.record_key("s", "r"))

    def test_missing_or_null_arrays_are_empty(self):
        push = sync.validate_push({"project": "p", "records": None})
        self.assertEqual((push.records, push.sessions, push.team), ([], [], None))


class FeedLineTest(unittest.TestCase):
    def test_round_trip(self):
        line = sync.feed_line(7, b"r", b'{"a":1}', key=0xABC)
        self.assertEqual(sync.parse_feed_line(line), (7, b"r", 0xABC, b'{"a":1}'))
        line = sync.feed_line(8, b"s", b'{"id":"s"}')
        self.assertEqual(sync.parse_feed_line(line), (8, b"s", None, b'{"id":"s"}'))
        self.assertEqual(json.loads(line)["n"], 8)  # still one JSON object per line

    def test_any_flipped_byte_is_detected(self):
        line = sync.feed_line(3, b"r", b'{"session":"s","id":"r","body":"hello"}', key=5)
        for i in range(len(line) - 1):
            damaged = line[:i] + bytes([line[i] ^ 0x01]) + line[i + 1:]
            try:
                parsed = sync.parse_feed_line(damaged)
            except ValueError:
                continue
            self.fail("flipped byte %d went unnoticed: %r" % (i, parsed))

    def test_split_events_without_parsing(self):
        data = sync.feed_line(1, b"r", b'{"x":",\\"e\\":"}', key=1) + sync.feed_line(2, b"s", b'{"id":"a"}')
        self.assertEqual(sync.split_events(data), ([b'{"x":",\\"e\\":"}'], [b'{"id":"a"}']))


# ---------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------

class LocalTokenTest(unittest.TestCase):
    def setUp(self):
        self.data_dir = tempfile.mkdtemp(prefix="ohs-test-")
        self.addCleanup(shutil.rmtree, self.data_dir, True)
        self.store = sync.TokenStore(self.data_dir)
        self.verifier = sync.LocalTokenVerifier(self.store)

    def reload(self):
        self.verifier._checked = float("-inf")  # skip the once-a-second wait

    def test_token_maps_to_principal_and_teams(self):
        token, record = self.store.issue("alice", ["platform", "ops"], name="laptop")
        self.assertEqual(self.verifier.verify(token), sync.Identity("alice", ["ops", "platform"]))
        self.assertRegex(token, r"^ohs_[0-9a-f]{12}_[A-Za-z0-9_-]{43}$")

    def test_only_the_hash_is_stored(self):
        token, record = self.store.issue("alice")
        with open(os.path.join(self.data_dir, "tokens.json"), encoding="utf-8") as f:
            text = f.read()
        self.assertNotIn(token, text)
        self.assertNotIn(token.rsplit("_", 1)[1], text)
        self.assertIn(sync.token_hash(token), text)

    def test_unknown_altered_revoked_and_expired_tokens_are_refused(self):
        token, record = self.store.issue("alice")
        with self.assertRaises(sync.AuthError):
            self.verifier.verify(token[:-1] + ("A" if token[-1] != "A" else "B"))
        with self.assertRaises(sync.AuthError):
            self.verifier.verify("ohs_000000000000_" + "x" * 43)
        with self.assertRaises(sync.AuthError):
            self.verifier.verify("not-a-token")
        now = [time.time()]
        verifier = sync.LocalTokenVerifier(self.store, clock=lambda: now[0])
        expiring, _ = self.store.issue("bob", expires_days=1)
        self.assertEqual(verifier.verify(expiring).principal, "bob")
        now[0] += 86401
        with self.assertRaises(sync.AuthError):
            verifier.verify(expiring)
        self.assertTrue(self.store.revoke(record["id"]))
        self.reload()
        with self.assertRaises(sync.AuthError):
            self.verifier.verify(token)
        self.assertFalse(self.store.revoke(record["id"]))

    def test_a_damaged_token_file_keeps_the_last_good_set(self):
        token, _ = self.store.issue("alice")
        self.assertEqual(self.verifier.verify(token).principal, "alice")
        with open(self.store.path, "w") as f:
            f.write("{not json")
        self.reload()
        self.assertEqual(self.verifier.verify(token).principal, "alice")

    def test_bearer_header(self):
        self.assertEqual(sync.bearer_token("Bearer abc.def"), "abc.def")
        self.assertEqual(sync.bearer_token("bearer  xyz"), "xyz")
        for header in (None, "", "Basic abc", "Bearer", "Bearer a b", "Bearer é"):
            with self.assertRaises(sync.AuthError, msg=header):
                sync.bearer_token(header)


# ---------------------------------------------------------------------------
# Storage: feeds
# ---------------------------------------------------------------------------

def validated(records=(), sessions=()):
    push = sync.validate_push({"project": "p", "records": list(records), "sessions": list(sessions)})
    return push.records, push.sessions


class FeedStoreTest(unittest.TestCase):
    owner = ("u", "alice")

    def setUp(self):
        self.data_dir = tempfile.mkdtemp(prefix="ohs-test-")
        self.addCleanup(shutil.rmtree, self.data_dir, True)
        self.log_lines = []
        self.store = sync.FeedStore(self.data_dir, self.log_lines.append)

    def reopen(self):
        self.store = sync.FeedStore(self.data_dir, self.log_lines.append)
        return self.store

    def path(self):
        return os.path.join(self.data_dir, "feeds", "u-alice", "p-p.jsonl")

    def test_restart_rebuilds_numbering_dedupe_and_winners(self):
        self.store.push(self.owner, "p", *validated([record(record_id="a"), record(record_id="b")],
                                                    [meta(gen=1, updated_at=5)]))
        store = self.reopen()
        self.assertEqual(store.push(self.owner, "p", *validated([record(record_id="a")], [meta(gen=1, updated_at=5)])),
                         (3, 0))
        self.assertEqual(store.push(self.owner, "p", *validated([record(record_id="c")], [meta(gen=1, updated_at=6)])),
                         (5, 2))
        page = store.pull(self.owner, "p", 0, 500)
        self.assertEqual([json.loads(r)["id"] for r in page.records], ["a", "b", "c"])
        self.assertEqual([json.loads(s)["updatedAt"] for s in page.sessions], [5, 6])

    def test_torn_last_line_is_cut_off_at_start(self):
        self.store.push(self.owner, "p", *validated([record(record_id="a"), record(record_id="b")]))
        with open(self.path(), "rb") as f:
            good = f.read()
        with open(self.path(), "ab") as f:
            f.write(good.splitlines(True)[0][:30])  # half a line, as a power cut leaves it
        store = self.reopen()
        self.assertEqual(store.push(self.owner, "p", *validated([record(record_id="c")])), (3, 1))
        with open(self.path(), "rb") as f:
            lines = f.read().splitlines(True)
        self.assertEqual(b"".join(lines[:2]), good)
        self.assertEqual(len(lines), 3)
        self.assertTrue(any("cut a torn last line" in line for line in self.log_lines))

    def test_damaged_middle_line_refuses_that_feed_only(self):
        self.store.push(self.owner, "p", *validated([record(record_id=str(i)) for i in range(3)]))
        self.store.push(("u", "bob"), "p", *validated([record()]))
        with open(self.path(), "rb") as f:
            lines = f.read().splitlines(True)
        lines[1] = lines[1].replace(b'"laptop"', b'"laptoq"')
        with open(self.path(), "wb") as f:
            f.write(b"".join(lines))
        store = self.reopen()
        with self.assertRaises(sync.FeedDamaged) as caught:
            store.pull(self.owner, "p", 0, 500)
        self.assertIn("p-p.jsonl:2: checksum mismatch", str(caught.exception))
        with self.assertRaises(sync.FeedDamaged):
            store.push(self.owner, "p", *validated([record(record_id="new")]))
        self.assertEqual(len(store.pull(("u", "bob"), "p", 0, 500).records), 1)
        with open(self.path(), "rb") as f:
            self.assertEqual(f.read(), b"".join(lines))  # nothing was cut or dropped

    def test_storage_failure_leaves_the_feed_exactly_as_before(self):
        self.store.push(self.owner, "p", *validated([record(record_id="a")], [meta(gen=0, updated_at=1)]))
        with open(self.path(), "rb") as f:
            before = f.read()
        for error in (errno.ENOSPC, errno.EIO):
            with mock.patch.object(sync, "sync_file", side_effect=OSError(error, os.strerror(error))):
                with self.assertRaises(sync.StorageError):
                    self.store.push(self.owner, "p", *validated([record(record_id="b")], [meta(gen=0, updated_at=2)]))
            with open(self.path(), "rb") as f:
                self.assertEqual(f.read(), before)
            page = self.store.pull(self.owner, "p", 0, 500)
            self.assertEqual((page.cursor, len(page.records), len(page.sessions)), (2, 1, 1))
        # The same push works afterwards: its record and metadata were not remembered as stored.
        self.assertEqual(self.store.push(self.owner, "p", *validated([record(record_id="b")],
                                                                     [meta(gen=0, updated_at=2)])), (4, 2))
        self.assertEqual(self.reopen().pull(self.owner, "p", 0, 500).cursor, 4)

    def test_failed_first_push_creates_no_feed(self):
        with mock.patch.object(sync, "sync_file", side_effect=OSError(errno.ENOSPC, "No space left on device")):
            with self.assertRaises(sync.StorageError):
                self.store.push(self.owner, "p", *validated([record()]))
        self.assertFalse(os.path.exists(self.path()))
        self.assertEqual(self.store.projects(self.owner), [])
        self.assertEqual(self.store.push(self.owner, "p", *validated([record()])), (1, 1))

    def test_concurrent_pushes_share_one_fsync(self):
        self.store.push(self.owner, "p", *validated([record(record_id="first")]))
        gate, entered = threading.Event(), threading.Event()
        calls = []
        real_sync = sync.sync_file

        def slow_sync(fd):
            calls.append(fd)
            if len(calls) == 1:
                entered.set()
                gate.wait(5)
            real_sync(fd)

        results = []
        with mock.patch.object(sync, "sync_file", slow_sync):
            first = threading.Thread(target=lambda: results.append(
                self.store.push(self.owner, "p", *validated([record(record_id="x")]))))
            first.start()
            entered.wait(5)
            others = [threading.Thread(target=lambda i=i: results.append(
                self.store.push(self.owner, "p", *validated([record(record_id="y%d" % i)])))) for i in range(8)]
            for thread in others:
                thread.start()
            time.sleep(0.3)  # let all eight queue behind the first fsync
            gate.set()
            for thread in [first] + others:
                thread.join(5)
        self.assertEqual(len(calls), 2)  # one for the first push, one for the eight queued behind it
        self.assertEqual(sorted(accepted for _, accepted in results), [1] * 9)
        self.assertEqual(self.store.pull(self.owner, "p", 0, 500).cursor, 10)

    def test_a_duplicate_of_an_in_flight_record_waits_for_it(self):
        gate, entered = threading.Event(), threading.Event()

        def failing_sync(fd):
            entered.set()
            gate.wait(5)
            raise OSError(errno.EIO, "I/O error")

        outcomes = []

        def push():
            try:
                outcomes.append(self.store.push(self.owner, "p", *validated([record()])))
            except sync.StorageError:
                outcomes.append("failed")

        with mock.patch.object(sync, "sync_file", failing_sync):
            first = threading.Thread(target=push)
            first.start()
            entered.wait(5)
            second = threading.Thread(target=push)  # a retry of the same record, while the first is in flight
            second.start()
            time.sleep(0.2)
            gate.set()
            first.join(5)
            second.join(5)
        # The retry found the record "already there" only in memory: it must not be answered 200.
        self.assertEqual(outcomes, ["failed", "failed"])
        self.assertEqual(self.store.push(self.owner, "p", *validated([record()])), (1, 1))

    def test_projects_lists_non_empty_feeds_sorted_and_decoded(self):
        for project in ("zeta", "Alpha", "alpha", "m_id"):
            self.store.push(self.owner, project, *validated([record()]))
        self.store.push(self.owner, "empty", *validated())
        self.store.pull(self.owner, "pulled", 0, 500)
        self.assertEqual(self.store.projects(self.owner), ["Alpha", "alpha", "m_id", "zeta"])
        self.assertEqual(self.store.projects(("t", "alice")), [])


# ---------------------------------------------------------------------------
# The HTTP layer: session sync on the wire
# ---------------------------------------------------------------------------

class HealthAndAuthTest(ServerCase):
    def test_health_needs_no_token(self):
        self.assertAnswer(self.request("GET", "/v1/health"), 200, {"ok": True})

    def test_every_data_route_refuses_a_missing_or_bad_token(self):
        calls = [("GET", "/v1/projects", None), ("GET", "/v1/pull?project=p&since=0", None),
                 ("POST", "/v1/push", {"project": "p", "records": [record()]})]
        revoked_token, revoked = self.tokens.issue("carol")
        self.tokens.revoke(revoked["id"])
        expired = self.issue("dave", expires_days=1e-9)
        for method, path, body in calls:
            for token in (None, "", "garbage", "ohs_000000000000_" + "x" * 43, revoked_token, expired,
                          self.alice + "x"):
                answer = self.request(method, path, body, token=token)
                self.assertAnswer(answer, 401)
                self.assertEqual(answer.headers.get("www-authenticate"), "Bearer")
                self.assertIsInstance(answer.json["error"], str)
        self.assertEqual(self.feed_files(), [])

    def test_a_new_token_works_and_a_revoked_one_stops_within_two_seconds(self):
        self.assertAnswer(self.request("GET", "/v1/projects", token=self.alice), 200)
        token, record_ = self.tokens.issue("erin")
        deadline = time.monotonic() + 2.0
        while self.request("GET", "/v1/projects", token=token).status != 200:
            self.assertLess(time.monotonic(), deadline, "new token not honoured within 2 s")
            time.sleep(0.1)
        self.tokens.revoke(record_["id"])
        deadline = time.monotonic() + 2.0
        while self.request("GET", "/v1/projects", token=token).status != 401:
            self.assertLess(time.monotonic(), deadline, "revoked token still honoured after 2 s")
            time.sleep(0.1)

    def test_the_access_log_names_the_principal_and_never_the_token(self):
        self.request("GET", "/v1/pull?project=p&since=0&secret=xyz", token=self.alice)
        self.request("GET", "/v1/projects", token=self.alice + "bad")
        text = "\n".join(self.log_lines)
        self.assertIn("GET /v1/pull 200", text)
        self.assertIn("alice", text)
        self.assertIn("GET /v1/projects 401", text)
        self.assertNotIn(self.alice, text)
        self.assertNotIn("xyz", text)


class PushPullTest(ServerCase):
    def test_seed_smoke_test(self):
        body = {"project": "conformance", "records": [record(body={"value": "unchanged"})], "sessions": []}
        self.assertAnswer(self.request("POST", "/v1/push", body, self.alice), 200, {"cursor": 1, "accepted": 1})
        self.assertAnswer(self.request("POST", "/v1/push", body, self.alice), 200, {"cursor": 1, "accepted": 0})
        self.assertAnswer(self.pull(self.alice, "conformance", 0, limit=500), 200,
                          {"cursor": 1, "records": [record(body={"value": "unchanged"})], "sessions": [],
                           "more": False})
        self.assertAnswer(self.pull(self.alice, "conformance", 1), 200,
                          {"cursor": 1, "records": [], "sessions": [], "more": False})

    def test_dedupe_across_and_within_requests(self):
        answer = self.push(self.alice, records=[record(record_id="a"), record(record_id="a", seq=2),
                                                record(record_id="b")])
        self.assertAnswer(answer, 200, {"cursor": 2, "accepted": 2})
        answer = self.push(self.alice, records=[record(record_id="b"), record(record_id="c"),
                                                record(session="s2", record_id="a")])
        self.assertAnswer(answer, 200, {"cursor": 4, "accepted": 2})
        pulled = self.pull(self.alice).json
        self.assertEqual([(r["session"], r["id"], r["seq"]) for r in pulled["records"]],
                         [("s1", "a", 1), ("s1", "b", 1), ("s1", "c", 1), ("s2", "a", 1)])

    def test_metadata_last_writer_wins_and_tombstones_reach_an_offline_reader(self):
        self.assertAnswer(self.push(self.alice, sessions=[meta(gen=1, updated_at=10, body={"title": "one"})]), 200,
                          {"cursor": 1, "accepted": 1})
        offline_cursor = 1  # a second device read up to here, then went offline
        cases = [
            (meta(gen=1, updated_at=10, body={"title": "same"}), 0),   # equal tuple: nothing
            (meta(gen=1, updated_at=9), 0),                            # older updatedAt
            (meta(gen=0, updated_at=99), 0),                           # older gen
            (meta(gen=1, updated_at=11, body={"title": "two"}), 1),    # later updatedAt wins
            (meta(gen=2, updated_at=1, deleted=True), 1),              # higher gen wins: a tombstone
        ]
        for entry, accepted in cases:
            self.assertEqual(self.push(self.alice, sessions=[entry]).json["accepted"], accepted, entry)
        # In one request, entries for one session apply in order.
        answer = self.push(self.alice, sessions=[meta(gen=3, updated_at=1), meta(gen=3, updated_at=2),
                                                 meta(gen=3, updated_at=1)])
        self.assertAnswer(answer, 200, {"cursor": 5, "accepted": 2})
        sessions = self.pull(self.alice, since=offline_cursor).json["sessions"]
        self.assertEqual(sessions, [meta(gen=1, updated_at=11, body={"title": "two"}),
                                    meta(gen=2, updated_at=1, deleted=True),
                                    meta(gen=3, updated_at=1), meta(gen=3, updated_at=2)])

    def test_accepted_counts_records_and_winning_metadata(self):
        answer = self.push(self.alice, records=[record(record_id="a"), record(record_id="b")],
                           sessions=[meta("s1"), meta("s2")])
        self.assertAnswer(answer, 200, {"cursor": 4, "accepted": 4})
        answer = self.push(self.alice, records=[record(record_id="a"), record(record_id="c")],
                           sessions=[meta("s1"), meta("s3")])
        self.assertAnswer(answer, 200, {"cursor": 6, "accepted": 2})

    def test_empty_push_answers_cursor_zero_and_creates_no_feed(self):
        self.assertAnswer(self.push(self.alice), 200, {"cursor": 0, "accepted": 0})
        self.assertAnswer(self.request("POST", "/v1/push", {"project": "p2"}, self.alice), 200,
                          {"cursor": 0, "accepted": 0})
        self.assertAnswer(self.pull(self.alice, "never"), 200,
                          {"cursor": 0, "records": [], "sessions": [], "more": False})
        self.assertAnswer(self.pull(self.alice, "never", 7), 200,
                          {"cursor": 7, "records": [], "sessions": [], "more": False})
        self.assertAnswer(self.request("GET", "/v1/projects", token=self.alice), 200, {"projects": []})
        self.assertEqual(self.feed_files(), [])

    def test_paging_with_more(self):
        self.push(self.alice, records=[record(record_id=str(i)) for i in range(5)], sessions=[meta()])
        pages, since = [], 0
        while True:
            page = self.pull(self.alice, since=since, limit=2).json
            pages.append((page["cursor"], len(page["records"]) + len(page["sessions"]), page["more"]))
            since = page["cursor"]
            if not page["more"]:
                break
        self.assertEqual(pages, [(2, 2, True), (4, 2, True), (6, 2, False)])
        self.assertAnswer(self.pull(self.alice, since=6, limit=2), 200,
                          {"cursor": 6, "records": [], "sessions": [], "more": False})
        self.assertAnswer(self.pull(self.alice, since=99), 200,
                          {"cursor": 99, "records": [], "sessions": [], "more": False})

    def test_bodies_come_back_unchanged_at_the_json_value_level(self):
        bodies = [
            {"text": "héllo wörld ✓ 日本語 😀 \u2028\u2029 \x00\x1f\x7f \\ \" /"},
            "\ud800 lone high, \udfff lone low",
            [12345678901234567890123456789, -0.5, 1.5e300, 5e-324, 0, -1, 2 ** 53 + 1],
            {"deep": [[[[{"a": [None, True, False, {}, []]}]]]]},
            None, 0, "", [],
        ]
        records = [record(record_id=str(i), body=body) for i, body in enumerate(bodies)]
        self.push(self.alice, records=records, sessions=[meta(body={"meta": bodies[0]})])
        pulled = self.pull(self.alice).json
        self.assertEqual(pulled["records"], records)
        self.assertEqual(pulled["sessions"], [meta(body={"meta": bodies[0]})])
        raw = self.pull(self.alice).raw
        self.assertIn(b"\\ud800", raw)  # a lone surrogate stays an escape, never invalid UTF-8
        raw.decode("utf-8")


class TenancyTest(ServerCase):
    def test_two_principals_with_one_project_id_see_only_their_own(self):
        self.push(self.alice, "shared", [record(body="alice's")])
        self.push(self.bob, "shared", [record(body="bob's")])
        self.assertEqual([r["body"] for r in self.pull(self.alice, "shared").json["records"]], ["alice's"])
        self.assertEqual([r["body"] for r in self.pull(self.bob, "shared").json["records"]], ["bob's"])
        self.assertEqual(self.push(self.bob, "shared", [record(body="again")]).json, {"cursor": 1, "accepted": 0})

    def test_team_feed_is_separate_from_personal_feeds(self):
        self.push(self.alice, "p", [record(record_id="personal")])
        self.assertAnswer(self.push(self.alice, "p", [record(record_id="team")], team="platform"), 200,
                          {"cursor": 1, "accepted": 1})
        self.assertEqual([r["id"] for r in self.pull(self.alice, "p").json["records"]], ["personal"])
        self.assertEqual([r["id"] for r in self.pull(self.alice, "p", team="platform").json["records"]], ["team"])
        carol = self.issue("carol", ["platform"])
        self.assertEqual([r["id"] for r in self.pull(carol, "p", team="platform").json["records"]], ["team"])
        self.assertEqual(self.pull(carol, "p").json["records"], [])
        self.assertEqual(self.request("GET", "/v1/projects?team=platform", token=carol).json, {"projects": ["p"]})
        self.assertEqual(self.request("GET", "/v1/projects", token=carol).json, {"projects": []})

    def test_a_principal_and_a_team_with_one_id_do_not_share_a_feed(self):
        platform_user = self.issue("platform")
        self.push(platform_user, "p", [record(record_id="principal")])
        self.push(self.alice, "p", [record(record_id="team")], team="platform")
        self.assertEqual([r["id"] for r in self.pull(platform_user, "p").json["records"]], ["principal"])

    def test_a_team_not_in_the_token_is_403_never_a_fallback(self):
        self.push(self.bob, "p", [record()])
        for answer in (self.push(self.bob, "p", [record(record_id="x")], team="platform"),
                       self.pull(self.bob, "p", team="platform"),
                       self.pull(self.bob, "p", team=""),
                       self.request("GET", "/v1/projects?team=platform", token=self.bob)):
            self.assertAnswer(answer, 403)
            self.assertIsInstance(answer.json["error"], str)
        self.assertEqual(len(self.pull(self.bob, "p").json["records"]), 1)

    def test_case_differing_principals_stay_two(self):
        upper = self.issue("Alice")
        self.push(self.alice, "Proj", [record(body="lower")])
        self.push(upper, "Proj", [record(body="upper")])
        self.push(upper, "proj", [record(body="upper, lower-case project")])
        self.assertEqual(self.pull(self.alice, "Proj").json["records"][0]["body"], "lower")
        self.assertEqual(self.pull(upper, "Proj").json["records"][0]["body"], "upper")
        self.assertEqual(self.request("GET", "/v1/projects", token=upper).json, {"projects": ["Proj", "proj"]})
        names = [os.path.relpath(path, self.data_dir) for path in self.feed_files()]
        self.assertEqual(len({name.lower() for name in names}), 3, names)


class LongPollTest(ServerCase):
    def pull_in_thread(self, results, token=None, project="proj", since=0, **params):
        def run():
            started = time.monotonic()
            answer = self.pull(token or self.alice, project, since, **params)
            results.append((time.monotonic() - started, answer))
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def wait_parked(self, count, timeout=5):
        deadline = time.monotonic() + timeout
        while self.server.busy < count:
            self.assertLess(time.monotonic(), deadline, "pulls did not park")
            time.sleep(0.01)
        time.sleep(0.05)

    def test_a_parked_pull_wakes_quickly_on_a_push_to_its_feed_only(self):
        results = []
        thread = self.pull_in_thread(results, wait=10)
        self.wait_parked(1)
        self.push(self.alice, "other", [record()])                  # another project
        self.push(self.bob, "proj", [record()])                     # another principal
        self.push(self.alice, "proj", [record()], team="platform")  # the team feed
        time.sleep(0.3)
        self.assertEqual(results, [])
        pushed = time.monotonic()
        self.push(self.alice, "proj", [record(record_id="wake")])
        thread.join(5)
        woke = time.monotonic()
        self.assertEqual(len(results), 1)
        self.assertLess(woke - pushed, 0.1 + 0.1)  # within 100 ms, plus this client's own overhead
        self.assertAnswer(results[0][1], 200)
        self.assertEqual([r["id"] for r in results[0][1].json["records"]], ["wake"])
        self.assertEqual(results[0][1].json["cursor"], 1)

    def test_time_out_is_an_empty_200(self):
        results = []
        self.pull_in_thread(results, since=0, wait=1).join(5)
        elapsed, answer = results[0]
        self.assertAnswer(answer, 200, {"cursor": 0, "records": [], "sessions": [], "more": False})
        self.assertGreaterEqual(elapsed, 0.95)
        self.assertEqual(self.feed_files(), [])

    def test_wait_returns_at_once_when_events_exist(self):
        self.push(self.alice, records=[record()])
        results = []
        self.pull_in_thread(results, since=0, wait=30).join(5)
        self.assertLess(results[0][0], 1)
        self.assertEqual(len(results[0][1].json["records"]), 1)

    def test_two_hundred_parked_pulls_all_wake_on_one_push(self):
        results = []
        threads = [self.pull_in_thread(results, wait=20) for _ in range(200)]
        self.wait_parked(200, timeout=20)
        self.push(self.alice, records=[record()])
        for thread in threads:
            thread.join(10)
        self.assertEqual(len(results), 200)
        for elapsed, answer in results:
            self.assertEqual((answer.status, answer.json["cursor"], len(answer.json["records"])), (200, 1, 1))

    def test_a_client_that_leaves_mid_wait_harms_nothing(self):
        sock = socket.create_connection(self.server.server_address[:2])
        sock.sendall(b"GET /v1/pull?project=proj&since=0&wait=2 HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + self.alice.encode() + b"\r\n\r\n")
        self.wait_parked(1)
        sock.close()
        time.sleep(0.1)
        self.assertAnswer(self.push(self.alice, records=[record()]), 200, {"cursor": 1, "accepted": 1})
        time.sleep(2.2)  # the abandoned pull times out and writes to a closed socket
        self.assertAnswer(self.pull(self.alice), 200)
        self.assertEqual(len(self.pull(self.alice).json["records"]), 1)
        self.assertEqual([line for line in self.log_lines if "error" in line.lower()], [])


# ---------------------------------------------------------------------------
# Durability: the server as a subprocess
# ---------------------------------------------------------------------------

class DurabilityTest(unittest.TestCase):
    def setUp(self):
        self.data_dir = tempfile.mkdtemp(prefix="ohs-test-")
        self.addCleanup(shutil.rmtree, self.data_dir, True)
        self.token, _ = sync.TokenStore(self.data_dir).issue("alice")

    def test_every_answered_push_survives_sigkill_exactly_once(self):
        server = SubprocessServer(self.data_dir)
        answered, stop = [], threading.Event()

        def pusher(worker):
            n = 0
            while not stop.is_set():
                records = [record(session="w%d" % worker, record_id="r%d-%d" % (n, k)) for k in range(3)]
                try:
                    answer = http_request(server.url, "POST", "/v1/push", {"project": "p", "records": records},
                                          self.token, timeout=5)
                except (OSError, http.client.HTTPException):
                    return
                if answer.status == 200:
                    answered.extend((r["session"], r["id"]) for r in records)
                n += 1

        workers = [threading.Thread(target=pusher, args=(i,)) for i in range(6)]
        for worker in workers:
            worker.start()
        time.sleep(random.uniform(0.5, 1.5))
        server.process.kill()  # SIGKILL at a random moment, pushes in flight
        server.stop()
        stop.set()
        for worker in workers:
            worker.join(10)
        self.assertGreater(len(answered), 30)

        server = SubprocessServer(self.data_dir)
        try:
            events, since = [], 0
            while True:
                page = http_request(server.url, "GET", "/v1/pull?project=p&since=%d" % since, token=self.token).json
                events.extend((r["session"], r["id"]) for r in page["records"])
                since = page["cursor"]
                if not page["more"]:
                    break
            self.assertEqual(len(events), len(set(events)), "a record is stored twice")
            self.assertEqual(set(answered) - set(events), set(), "an answered push was lost")
            self.assertEqual(since, len(events))
            answer = http_request(server.url, "POST", "/v1/push",
                                  {"project": "p", "records": [record(session="after", record_id="restart")]},
                                  self.token)
            self.assertEqual(answer.json, {"cursor": since + 1, "accepted": 1})  # numbering continues
        finally:
            server.stop()


class CommandLineTest(unittest.TestCase):
    def setUp(self):
        self.data_dir = tempfile.mkdtemp(prefix="ohs-test-")
        self.addCleanup(shutil.rmtree, self.data_dir, True)

    def run_cli(self, *args):
        return subprocess.run([sys.executable, MODULE] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=30, universal_newlines=True)

    def test_serving_prints_one_line_and_creates_the_data_dir(self):
        data_dir = os.path.join(self.data_dir, "new", "dir")
        server = SubprocessServer(data_dir)
        try:
            self.assertRegex(server.url, r"^http://127\.0\.0\.1:\d+$")
            self.assertNotEqual(server.url, "http://127.0.0.1:0")
            self.assertEqual(http_request(server.url, "GET", "/v1/health").json, {"ok": True})
            self.assertTrue(os.path.isdir(data_dir))
        finally:
            code, stderr = server.stop()
        self.assertEqual(code, 0)
        self.assertEqual(server.process.returncode, 0)

    def test_a_second_server_on_one_data_dir_exits_at_once(self):
        server = SubprocessServer(self.data_dir)
        try:
            result = self.run_cli("--data", self.data_dir, "--port", "0")
            self.assertNotEqual(result.returncode, 0)
            self.assertEqual(result.stdout, "")
            self.assertIn("already using", result.stderr)
            self.assertEqual(len(result.stderr.strip().splitlines()), 1)
        finally:
            server.stop()

    def test_bad_flags_and_unusable_data_dir_exit_2_with_one_line(self):
        blocker = os.path.join(self.data_dir, "file")
        open(blocker, "w").close()
        for args in (["--data", self.data_dir, "--port", "x"], ["--data", self.data_dir, "--bogus"], [],
                     ["--data", os.path.join(blocker, "sub")], ["--data", self.data_dir, "--port", "70000"],
                     ["token", "issue", "--data", self.data_dir, "--principal", "a/b"], ["token", "frob"]):
            result = self.run_cli(*args)
            self.assertEqual(result.returncode, 2, args)
            self.assertEqual(len(result.stderr.strip().splitlines()), 1, (args, result.stderr))
            self.assertNotIn("Traceback", result.stderr)

    def test_token_issue_list_revoke(self):
        result = self.run_cli("token", "issue", "--data", self.data_dir, "--principal", "alice",
                              "--team", "platform", "--team", "ops", "--name", "laptop", "--expires-days", "30")
        self.assertEqual(result.returncode, 0)
        token = result.stdout.strip()
        self.assertEqual(result.stdout, token + "\n")  # the token and nothing else
        self.assertRegex(token, r"^ohs_[0-9a-f]{12}_")
        token_id = token[4:16]
        self.assertIn(token_id, result.stderr)
        self.assertIn("alice", result.stderr)
        listing = self.run_cli("token", "list", "--data", self.data_dir)
        self.assertEqual(listing.returncode, 0)
        self.assertIn(token_id, listing.stdout)
        self.assertIn("ops,platform", listing.stdout)
        self.assertIn("laptop", listing.stdout)
        self.assertNotIn(token, listing.stdout)
        self.assertEqual(self.run_cli("token", "revoke", "--data", self.data_dir, token_id).returncode, 0)
        self.assertNotIn(token_id, self.run_cli("token", "list", "--data", self.data_dir).stdout)
        self.assertEqual(self.run_cli("token", "revoke", "--data", self.data_dir, token_id).returncode, 1)

    def test_sigterm_answers_parked_polls_and_exits_0(self):
        token, _ = sync.TokenStore(self.data_dir).issue("alice")
        server = SubprocessServer(self.data_dir)
        results = []
        thread = threading.Thread(target=lambda: results.append(
            http_request(server.url, "GET", "/v1/pull?project=p&since=0&wait=30", token=token, timeout=40)))
        thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        code, stderr = server.stop(signal.SIGTERM)
        thread.join(10)
        self.assertEqual(code, 0)
        self.assertLess(time.monotonic() - started, 5)
        self.assertEqual(results[0].status, 200)
        self.assertEqual(results[0].json, {"cursor": 0, "records": [], "sessions": [], "more": False})
        self.assertNotIn("Traceback", stderr)


if __name__ == "__main__":
    unittest.main()
