#!/usr/bin/env python3
"""oharness-sync: a self-hosted sync server for OHarness, in one file.

OHarness clients mirror session transcripts, artifact revisions and session
metadata to a sync server (session sync: an append-only feed per owner and
project, with push, pull and long-poll), and reconcile Markdown memory notes
through it (memory sync: a manifest with compare-and-swap on ETags).
This module speaks protocol version 1, as used by OHarness 0.5.x, and needs
nothing but Python 3.9 or newer and its standard library.

Usage:
    python3 oharness_sync.py --data DIR [--host 127.0.0.1] [--port 8787] ...
    python3 oharness_sync.py token issue  --data DIR --principal ID [--team ID]...
    python3 oharness_sync.py token list   --data DIR
    python3 oharness_sync.py token revoke --data DIR TOKEN_ID
    python3 oharness_sync.py fsck --data DIR [--repair]
    python3 oharness_sync.py note-hash FILE
    python3 oharness_sync.py check --url URL --token-file FILE [--other-token-file FILE]
                                   [--team ID] [--memory --principal ID] [--ca-file CA.pem]
    python3 oharness_sync.py replicate --from URL --from-token-file FILE --to URL
                                       --to-token-file FILE [--follow] [--state FILE] ...
    python3 oharness_sync.py usage   --data DIR [--json] [--principals-file FILE]
    python3 oharness_sync.py compact --data DIR [--retain-deleted-days N]
    python3 oharness_sync.py purge   --data DIR --principal ID [--dry-run]
    python3 oharness_sync.py backup  --data DIR (--to DEST | --tar FILE|- | --mark-restored)
    python3 oharness_sync.py bench [--url URL --token-file FILE] [--seconds N] [--clients N]

How to read it. The file is two parts, each read top-down.

Part I, the server, is what `--data DIR` runs:
    Constants and limits
    Errors              one family (SyncError): storage's errors in its own words
                        (Conflict, QuotaExceeded, ManifestDamaged, ...), and
                        ApiError's kinds, each with its HTTP status on its class
    Validation and hashing
                        pure rules: ids and numbers, a push, a note and its hash
                        (JavaScript's JSON.stringify), a memory request
    Metrics             what the server counts (its route labels: the app's
                        routes), and its Prometheus exposition
    Authentication      one small verifier per token kind: local tokens, JWTs
                        (HS256, RS256, ES256), Supabase; the guard against
                        forged ones; who may use the server (PrincipalList);
                        the Authenticator that picks
    Storage             files, the data dir's layout (DataDir: long ids under
                        a hash, their full form in a name file), every open
                        of a data-dir file without following a link
                        (open_in_data_dir), its lock (DataDirLock: the
                        server's, or a tool's that needs the dir to itself)
                        and the tokens; what a write may not pass
                        (StorageLimits: quotas, the DiskReserve); session
                        feeds (one scanner of a feed file, group commit,
                        long-poll waits (FeedWaiter), compaction); memory
                        manifests; a restored copy's first start
    HTTP                the one place an exception becomes an answer
                        (error_response, by ERROR_ANSWERS); the protocol's route
                        table and thin handlers (SyncApp), the strict reading of
                        a request, the transport on http.server
                        (SyncRequestHandler, SyncServer)
    Serving             flags (--data and --retain-deleted-days as every
                        command takes them) made one ServerConfig
                        (config_from_flags), build_server (every part given
                        the one log and the one Metrics), signals;
                        SyncServer.stop is the one way to stop
Storage knows nothing of HTTP, and the HTTP layer does no storage work.

Part II, the tools, holds the clients of Part I: the protocol client first (check
and replicate talk to a server through it), then token, fsck, note-hash,
check, replicate, usage, compact, purge, backup and bench; last the command
table (COMMANDS: each command's function, its summary for --help and its
synopsis in the usage list above) and main, which runs it. Part I names nothing
of Part II (serve's --help is given the table).
"""

import argparse
import array
import base64
import bisect
import collections
import contextlib
import dataclasses
import difflib
import errno
import hashlib
import hmac
import html
import http.client
import http.server
import io
import ipaddress
import json
import math
import multiprocessing
import queue
import os
import platform
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import tarfile
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.parse
import urllib.request
import weakref
import zlib
from collections import OrderedDict

try:
    import fcntl
except ImportError:  # Windows: the data-dir lock falls back to msvcrt
    fcntl = None

try:
    import resource
except ImportError:  # Windows
    resource = None

try:
    import pwd
except ImportError:  # Windows: owners are named by number
    pwd = None

__version__ = "0.2.0"


# =================================================================================================
# Part I. The server
#
# What `python3 oharness_sync.py --data DIR` runs, top-down: constants and limits; errors; the
# pure rules (validation and hashing); authentication; storage (files and tokens, session feeds,
# memory); HTTP (the protocol's routes and handlers, then the transport on http.server); the
# wiring that serves. Part I names nothing of Part II.
# =================================================================================================


# -------------------------------------------------------------------------------------------------
# Constants and limits
# -------------------------------------------------------------------------------------------------

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787

MAX_SAFE_INTEGER = 2 ** 53 - 1
MAX_ENTRY_ID_LENGTH = 1024          # a record's session and id strings
MAX_JSON_DEPTH = 200                # deeper request JSON is refused with 400

MAX_PUSH_BYTES = 8 * 1024 * 1024
MAX_PUSH_RECORDS = 500
MAX_PUSH_SESSIONS = 500
MAX_PULL_LIMIT = 500
# A pull page stops before its lines pass this (it holds one event at least, however large).
MAX_PAGE_BYTES = 8 * 1024 * 1024
# A push body opening more arrays and objects than this is refused with 413 before it is decoded:
# 500 records of large transcripts hold some thousands; 8 MiB of `{},` would hold 2.8 million.
MAX_PUSH_CONTAINERS = 200000
MAX_WAIT_SECONDS = 30
# Feed files open at once, at most (also bounded by a quarter of the open-file limit): each keeps
# its index in memory, which a feed evicted to make room for another loads again when next used.
MAX_OPEN_FEEDS = 512
FEED_ROOM_SECONDS = 10.0            # a request waits this long for a feed when all are in use
# The latest page read of a feed is kept for the next pull up to this size.
CACHED_PAGE_BYTES = 256 * 1024
COMPACT_CHECK_SECONDS = 30          # how often the server looks for a feed worth compacting
COMPACT_MIN_BYTES = 1024 * 1024     # ... and compacts one that drops this much, and half its file
DEFAULT_RETAIN_DELETED_DAYS = 90    # a deleted session's records are erased this long after
PAUSE_LINES = 128                   # a background compaction lets pushes in after this many lines
COMPACT_SYNC_BYTES = 1024 * 1024    # ... and fsyncs what it wrote after this many bytes
# A restored copy's feeds number on this far past the highest number in it, and this much further
# for each millisecond since the copy was taken (apply_restore says why).
RESTORE_JUMP = 1 << 32
RESTORE_JUMP_PER_MS = 1024

# Headers and body of one request must arrive within this, in total.
DEFAULT_REQUEST_SECONDS = 30.0
# An idle keep-alive connection is closed; also bounds each response's send.
IDLE_SECONDS = 60.0
MAX_HEADERS = 100                   # lines in one request's headers, the closing blank one too
DEFAULT_MAX_CONNECTIONS = 2000
DEFAULT_MAX_PARKED = 1500           # long-polls held at once; past it a pull answers at once
# By default one client address (IPv6: one /64) holds at most a quarter of --max-connections (and
# one principal's long-polls half of --max-parked): no one takes every place from the others.
PER_ADDRESS_SHARE = 4
LISTEN_BACKLOG = 512
MAX_LOGGED_READ_FAILURES = 1024     # distinct read failures logged once each (then forgotten)
MAX_HEAD_BYTES = 65536              # the request line and every header line together
SWEEP_SECONDS = 0.25                # how often the watchdog looks at the connections' deadlines
# After a last response, what the client still sends is dropped this long.
LINGER_SECONDS = 2.0
PARKED_CHECK_SECONDS = 5.0          # how often a parked pull looks whether its client has left
# Small stacks for the connection threads (1,000 parked pulls on a 32-bit Pi).
THREAD_STACK_BYTES = 512 * 1024
TOKEN_RELOAD_SECONDS = 1.0          # how often a running server looks at the token file
ACCEPT_POLL_SECONDS = 0.5           # how often serve_forever looks whether to stop (a stop wakes
# it at once where shutting its socket ends a poll, as on Linux)
STOP_GRACE_SECONDS = 10.0           # a stop's wait for the requests being answered

LOCAL_TOKEN_PREFIX = "ohs_"

# Sharing the server
MAX_PRINCIPALS_FILE_BYTES = 1024 * 1024  # a larger --principals-file is refused
FEED_LINE_FRAMING = 96                   # a feed line's bytes around its event, at most
# --reserve-disk's default: the larger of these
DEFAULT_RESERVE_BYTES = 256 * 1024 * 1024
DEFAULT_RESERVE_SHARE = 0.02                # ... and this share of the file system
DISK_CHECK_SECONDS = 1.0                    # how often a write asks the disk's free space at most
DISK_FULL_RETRY_SECONDS = 60                # the Retry-After of a write refused at the reserve

# Memory sync
MEMORY_QUOTA = {"maxNotes": 5000, "maxChanges": 500, "maxNoteBytes": 131072, "tombstoneDays": 90}
# A larger request body is refused with 413 before it is read.
MAX_MEMORY_BODY = 4 * 1024 * 1024
# Snapshot bodies up to this size have their checked fields remembered.
REMEMBERED_BODY_BYTES = 512
REMEMBERED_BODIES = 1024                # ... this many of them (then forgotten all at once)
MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024   # the entries of a full snapshot, as JSON
MANIFEST_CACHE_SIZE = 256               # scopes whose parsed manifest stays in memory
# An unreferenced revision is kept this long before it is removed.
GARBAGE_AGE_SECONDS = 3600
DAY_MS = 24 * 60 * 60 * 1000
# Memory requests per minute and principal (20/s), bursts of 600.
DEFAULT_MEMORY_RATE_LIMIT = 1200

# JWTs and identity services
LEEWAY_SECONDS = 60            # allowed clock skew for exp and nbf
MAX_TOKEN_LENGTH = 16384       # longer bearer tokens are refused unread
MIN_METRICS_TOKEN_LENGTH = 16  # a shorter --metrics-token-file is refused (guessable)
TOKEN_CACHE_SIZE = 10000       # verified tokens remembered (least recently used dropped)
TOKEN_CACHE_MAX_AGE = 3600     # a verified token is re-checked at least hourly
JWKS_REFETCH_INTERVAL = 60     # an unknown kid refetches a JWKS URL at most this often
JWKS_MAX_AGE = 600             # a JWKS URL is refreshed on use once its keys are this old
# A JWKS file's mtime is looked at this often at most (and for an unknown kid).
JWKS_FILE_CHECK_INTERVAL = 1
# Unknown kids remembered with the fetch they were first asked for after.
JWKS_UNKNOWN_KIDS = 1024
MAX_RESPONSE_BYTES = 1 << 20   # largest JWKS or user document read from the network
# A JWT or Supabase token refused once is refused again, unchecked, this long.
FAILED_TOKEN_SECONDS = 600
FAILED_TOKENS = 10000          # ... this many of them (least recently used dropped)
# JWT or Supabase tokens that may fail verification per client address, sustained, ...
FAILED_CHECKS_PER_MINUTE = 20
FAILED_CHECKS_BURST = 10       # ... and in a burst; past it a new token is refused unchecked (429)


# -------------------------------------------------------------------------------------------------
# Errors
# -------------------------------------------------------------------------------------------------

# One family, SyncError: what a request may fail with, each answered by error_response (the HTTP
# layer's one place for it). An ApiError is refused by the HTTP layer or the pure rules and has
# its status on its class; storage's errors say what went wrong in its own words (Conflict,
# QuotaExceeded, ManifestDamaged, ...), and ERROR_ANSWERS gives each its status.

class SyncError(Exception):
    """What a request may fail with (anything else is an internal error: 500)."""


class ApiError(SyncError):
    """A request refused by the HTTP layer or the pure rules: its status (on the class), a short
    text and, for a memory route, the contract's code (the class's own unless given)."""

    status = 400
    code = None

    def __init__(self, text, code=None, retry_after=None):
        super().__init__(text)
        self.text = text
        if code is not None:
            self.code = code
        self.retry_after = retry_after  # whole seconds until it may be tried again, or None


class BadRequest(ApiError):
    code = "invalid_body"


class Forbidden(ApiError):
    status = 403


class TooLarge(ApiError):
    status = 413
    code = "memory_quota_exceeded"


class UnsupportedType(ApiError):
    status = 415


class RateLimited(ApiError):
    status = 429


class HeadRefused(ApiError):
    """A request head that breaks a rule (a malformed one: 400): answered, then the connection
    closes."""


class UriTooLong(HeadRefused):
    status = 414


class HeadTooLarge(HeadRefused):
    status = 431


class VersionRefused(HeadRefused):
    status = 505


class Busy(ApiError):
    """A connection past a cap (SyncServer): answered by the accepting thread, then closed."""
    status = 503


class AuthFailure(SyncError):
    """What a token's check may raise: the token is refused, or cannot be checked now."""


class AuthError(AuthFailure):
    """The bearer token is missing, malformed, unknown, expired or badly signed (answers 401).
    lasting=False: the same token may pass later (it is not valid yet, or its key may yet be
    published), so the refusal is not remembered."""

    def __init__(self, text, lasting=True):
        super().__init__(text)
        self.lasting = lasting


class NotListed(AuthFailure):
    """A valid token whose principal the principals file does not list (answers 403)."""


class AuthUnavailable(AuthFailure):
    """The identity service could not be asked (answers 502 auth_unavailable)."""


class AuthThrottled(AuthFailure):
    """Too many tokens from this client failed verification lately: a new one is not checked
    (answers 429)."""

    def __init__(self, retry_after):
        super().__init__("too many tokens from this client failed verification lately")
        self.retry_after = retry_after  # whole seconds until the next one is checked


class StorageError(SyncError):
    """The disk refused a write; nothing of the request was kept."""


class QuotaExceeded(SyncError):
    """A push or memory commit would pass a quota (its principal's storage, or a memory scope's
    notes or snapshot size); nothing of it was stored."""


class StorageQuotaExceeded(QuotaExceeded):
    """A push or memory commit would take its principal past their storage quota."""

    def __init__(self, quota, stored):
        super().__init__("storage quota of %s reached (%s stored); nothing was stored: delete "
                         "sessions or notes to make room, or ask the server's operator for more"
                         % (format_size(quota), format_bytes(stored)))
        self.quota = quota
        self.stored = stored


class LinkRefused(OSError):
    """A link where a file or directory of the data dir should be: never followed (fsck --repair
    removes it)."""

    def __init__(self, path):
        super().__init__(errno.ELOOP, "a link, refused: nothing in a data dir is ever followed "
                                      "through a link (fsck --repair removes it)", path)


class DiskLow(SyncError):
    """A push or memory commit would leave the data dir's disk less free space than its reserve;
    nothing of it was stored."""

    def __init__(self, free, reserve):
        super().__init__("the server's disk is almost full (%s free, %s kept in reserve); nothing "
                         "was stored: try again later" % (format_bytes(max(free, 0)),
                                                         format_size(reserve)))
        self.retry_after = DISK_FULL_RETRY_SECONDS


class CompactionStopped(Exception):
    """The server is stopping: a compaction under way ends, and leaves its feed as it was."""


class FeedDamaged(SyncError):
    """A feed file has a damaged line in the middle; the feed is refused until repaired."""


class Conflict(SyncError):
    """A memory commit's etag is no longer its scope's: nothing of it was stored."""


class CaseConflict(SyncError):
    """A memory commit would keep two live notes whose ids differ only in case."""


class ManifestDamaged(SyncError):
    """A memory scope's manifest cannot be read, or is damaged (logged)."""


class NoteMissing(SyncError):
    """A live note's object is not there (logged)."""


class NoteDamaged(SyncError):
    """A live note's object does not hash to its manifest's hash (logged)."""


class CommitFailed(SyncError):
    """A memory commit could not be stored (logged); its scope's manifest is as it was."""


class InvalidNote(ValueError):
    """A note failed validation; the message is a short human reason."""


class AuthNotConfigured(AuthFailure):
    """Memory sync has no identity verifier (--memory-auth off)."""


class ClientGone(Exception):
    """The client closed its connection, or broke the framing of its request: no response is
    sent."""


class EncryptedKey(Exception):
    """A TLS key asked for its passphrase (which the server never has)."""


class UsageError(Exception):
    """A command-line problem: printed as one line, exit code 2."""


def reason(exc):
    """The short reason of an error for a one-line message: an OSError's text without its errno and
    path, else the error's own text."""
    return getattr(exc, "strerror", None) or exc


class LogOnce:
    """A log that writes each distinct line once: a read that fails fails again at every poll of
    every device. Past MAX_LOGGED_READ_FAILURES lines it forgets them all."""

    def __init__(self, log):
        self.log = log
        self.said = set()

    def __call__(self, line):
        if line not in self.said:
            if len(self.said) >= MAX_LOGGED_READ_FAILURES:
                self.said.clear()
            self.said.add(line)
            self.log(line)


def plural(count, noun):
    """The count and the noun, plural unless the count is 1 ("1 token", "2 tokens")."""
    return "%d %s%s" % (count, noun, "" if count == 1 else "es" if noun.endswith("sh") else "s")


def format_bytes(count):
    """A byte count for a person: in bytes, KiB, MiB or GiB."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return "%d %s" % (count, unit) if unit == "bytes" else "%.1f %s" % (count, unit)
        count /= 1024.0


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?) ?([KMGT]?i?B)?", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text):
    """The bytes of a size as a person writes it: 4096 (bytes), 500MiB, 2GiB or 1.5 TiB (powers of
    1024), 2GB or 1TB (powers of 1000, as disks are sold); ValueError for anything else."""
    match = _SIZE.fullmatch(text.strip())
    unit = (match.group(2) or "b").lower() if match else None
    if unit not in _SIZE_UNITS:
        raise ValueError("%r is not a size (such as 500MiB, 2GiB or 1TB)" % text)
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(count):
    """A size as an operator would write it: exact when it is a whole number of its unit (2 GiB),
    else format_bytes."""
    for unit, size in (("TiB", 1 << 40), ("TB", 10 ** 12), ("GiB", 1 << 30), ("GB", 10 ** 9),
                       ("MiB", 1 << 20), ("MB", 10 ** 6), ("KiB", 1 << 10), ("KB", 10 ** 3)):
        if count >= size and count % size == 0:
            return "%d %s" % (count // size, unit)
    return format_bytes(count)


# -------------------------------------------------------------------------------------------------
# Validation and hashing (pure functions)
# -------------------------------------------------------------------------------------------------

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
RESERVED_IDS = frozenset({"__proto__", "constructor", "prototype"})


def is_valid_id(value):
    """True for an id the protocol allows: [A-Za-z0-9_-]{1,128}, not a JavaScript prototype
    name."""
    return (isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None
            and value not in RESERVED_IDS)


def as_safe_int(value):
    """The value as a non-negative safe integer, or None.

    Booleans are not numbers; an integral float such as 12.0 counts as 12.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_SAFE_INTEGER:
        return value
    return None


def is_entry_id(value):
    """A record's session or id: a non-empty string of at most 1024 characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_ENTRY_ID_LENGTH


def _refuse_constant(name):
    raise ValueError("%s is not JSON" % name)


def _finite_float(text):
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError("number out of range")
    return value


_STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_ESCAPED_QUOTE_OR_BACKSLASH = re.compile(rb'\\[\\"]')
_JSON_STRING = re.compile(rb'"[^"]*"')
_NOT_A_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


def json_too_deep(data, limit=MAX_JSON_DEPTH):
    """True when arrays and objects in the JSON bytes data nest deeper than limit.

    Checked before json.loads, whose C parser recurses on a small thread stack. Most bodies open no
    more than limit of them in all, which one pass tells (bytes.translate keeping only the
    brackets: half the cost of two str.count over a 40 KB snapshot); the others are looked at
    without strings.
    """
    brackets = data.translate(None, _NOT_A_BRACKET)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return False
    depth = 0
    outside_strings = _JSON_STRING.sub(b"", _ESCAPED_QUOTE_OR_BACKSLASH.sub(b"", data))
    for char in outside_strings.translate(None, _NOT_A_BRACKET):
        depth += 1 if char in b"[{" else -1
        if depth > limit:
            return True
    return False


def too_many_containers(data, limit):
    """True when the JSON bytes data open more than limit arrays and objects. A body under
    2 * (limit - MAX_JSON_DEPTH) bytes cannot (a container takes two brackets, but for the
    MAX_JSON_DEPTH at most that json_too_deep lets stay open): the pushes of every day are not
    looked at. A longer one is counted over its brackets alone (as json_too_deep does), and only
    when they are too many, again without strings."""
    if len(data) < 2 * (limit - MAX_JSON_DEPTH):
        return False
    brackets = data.translate(None, _NOT_A_BRACKET)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return False
    outside_strings = _JSON_STRING.sub(b"", _ESCAPED_QUOTE_OR_BACKSLASH.sub(b"", data))
    return outside_strings.count(b"[") + outside_strings.count(b"{") > limit


def decode_json(data, max_depth=MAX_JSON_DEPTH):
    """Parse request bytes as strict JSON (UTF-8, no NaN or Infinity, nesting bounded by max_depth;
    None: only by the interpreter's recursion limit, for a thread with a full-size stack).

    Raises ValueError with a short reason.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("body is not valid UTF-8") from None
    if max_depth is not None and json_too_deep(data, max_depth):
        raise ValueError("JSON is nested too deeply")
    try:
        return _STRICT_JSON.decode(text)
    except (ValueError, RecursionError):
        raise ValueError("body is not valid JSON") from None


# No check for circular references: what is encoded was decoded from JSON, or built here, and
# has none.
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                                 check_circular=False)
_ASCII_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)


def encode_json(value):
    """Compact JSON as UTF-8 bytes; lone surrogates are written as \\uXXXX escapes."""
    text = _COMPACT_JSON.encode(value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _ASCII_JSON.encode(value).encode("ascii")


def record_key(session, record_id):
    """The dedupe key of a record: 128 bits of BLAKE2b over (session, id), as an int.

    A compact int instead of the two strings keeps a million keys in about 85 MB.
    The session's length goes first, so ("a", "bc") and ("ab", "c") differ.
    """
    material = ("%d:%s%s" % (len(session), session, record_id)).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(material, digest_size=16).digest(), "big")


def metadata_wins(new_stamp, old_stamp):
    """Last-writer-wins on (gen, updatedAt): a higher gen wins, then a higher updatedAt."""
    return old_stamp is None or new_stamp > old_stamp


class PushRecord:
    """A validated record: its dedupe key and its canonical JSON bytes."""
    __slots__ = ("key", "event")

    def __init__(self, key, event):
        self.key = key
        self.event = event


class PushSession:
    """Validated session metadata: its id, (gen, updatedAt), whether it deletes the session, and
    canonical JSON bytes."""
    __slots__ = ("session_id", "stamp", "deleted", "event")

    def __init__(self, session_id, stamp, event, deleted=False):
        self.session_id = session_id
        self.stamp = stamp
        self.event = event
        self.deleted = deleted


class PushRequest:
    """A whole validated push: project, team (or None), records and session entries."""
    __slots__ = ("project", "team", "records", "sessions")

    def __init__(self, project, team, records, sessions):
        self.project = project
        self.team = team
        self.records = records
        self.sessions = sessions


def _entry_list(doc, name, limit):
    entries = doc.get(name)
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise BadRequest("%s must be an array" % name)
    if len(entries) > limit:
        raise TooLarge("more than %d %s in one push" % (limit, name))
    return entries


def validate_record(record, index):
    """Check one pushed record; return a PushRecord with exactly the protocol's fields."""
    if not isinstance(record, dict):
        raise BadRequest("records[%d] is not an object" % index)
    session, record_id, device = record.get("session"), record.get("id"), record.get("device")
    if not is_entry_id(session):
        raise BadRequest("records[%d].session must be a non-empty string of at most %d characters"
                         % (index, MAX_ENTRY_ID_LENGTH))
    if not is_entry_id(record_id):
        raise BadRequest("records[%d].id must be a non-empty string of at most %d characters"
                         % (index, MAX_ENTRY_ID_LENGTH))
    if not isinstance(device, str):
        raise BadRequest("records[%d].device must be a string" % index)
    seq, at = as_safe_int(record.get("seq")), as_safe_int(record.get("at"))
    if seq is None:
        raise BadRequest("records[%d].seq must be a non-negative safe integer" % index)
    if at is None:
        raise BadRequest("records[%d].at must be a non-negative safe integer" % index)
    if "body" not in record:
        raise BadRequest("records[%d].body is missing" % index)
    event = {"session": session, "id": record_id, "seq": seq, "device": device, "at": at,
             "body": record["body"]}
    return PushRecord(record_key(session, record_id), encode_json(event))


def validate_session_entry(entry, index):
    """Check one session metadata entry; return a PushSession with exactly the pushed fields."""
    where = "sessions[%d]" % index
    if not isinstance(entry, dict):
        raise BadRequest("%s is not an object" % where)
    session_id = entry.get("id")
    if not isinstance(session_id, str) or not session_id:
        raise BadRequest("%s.id must be a non-empty string" % where)
    gen, updated_at = as_safe_int(entry.get("gen")), as_safe_int(entry.get("updatedAt"))
    if gen is None:
        raise BadRequest("%s.gen must be a non-negative safe integer" % where)
    if updated_at is None:
        raise BadRequest("%s.updatedAt must be a non-negative safe integer" % where)
    event = {"id": session_id, "gen": gen, "updatedAt": updated_at}
    if "deleted" in entry:
        if not isinstance(entry["deleted"], bool):
            raise BadRequest("%s.deleted must be a boolean" % where)
        event["deleted"] = entry["deleted"]
    if "body" in entry:
        event["body"] = entry["body"]
    return PushSession(session_id, (gen, updated_at), encode_json(event),
                       deleted=event.get("deleted") is True)


def validate_push(doc):
    """Check a whole push body before anything is written; return a PushRequest.

    Unknown fields are ignored, a top-level device included.
    """
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object")
    project = doc.get("project")
    if not is_valid_id(project):
        raise BadRequest("project must be an id of 1 to 128 characters [A-Za-z0-9_-]")
    team = doc.get("team")
    if team is not None and not isinstance(team, str):
        raise BadRequest("team must be a string")
    records = _entry_list(doc, "records", MAX_PUSH_RECORDS)
    sessions = _entry_list(doc, "sessions", MAX_PUSH_SESSIONS)
    return PushRequest(
        project, team,
        [validate_record(record, i) for i, record in enumerate(records)],
        [validate_session_entry(entry, i) for i, entry in enumerate(sessions)],
    )


# -- JavaScript string semantics, note validation and the note hash ----------
#
# Notes are hashed by clients with JSON.stringify, so the byte-exact JavaScript
# behaviour matters: lengths are UTF-16 code units, "trim" and /\s/ use the
# ECMAScript whitespace set (not Python's), and lone surrogates are escaped.

JS_WHITESPACE = (
    "\t\n\v\f\r \xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
)
_JS_LINE_BREAKS = "\n\r\u2028\u2029"
NOTE_FIELDS = frozenset(
    ["id", "summary", "body", "tags", "type", "createdAt", "updatedAt"])
_NOTE_TYPES = frozenset(["user", "feedback", "project", "reference"])
_MAX_SUMMARY_LENGTH = 500
_MAX_TAGS = 30
_MAX_TAG_LENGTH = 64

_JS_WHITESPACE_RE = re.compile("[" + re.escape(JS_WHITESPACE) + "]")
_LONE_SURROGATE_RE = re.compile(
    "[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]")


def js_length(s):
    """JavaScript string length: UTF-16 code units (astral chars count 2)."""
    if s.isascii():
        return len(s)
    return len(s.encode("utf-16-le", "surrogatepass")) // 2


def js_trim(s):
    """JavaScript String.prototype.trim()."""
    return s.strip(JS_WHITESPACE)


def has_js_whitespace(s):
    """True if s matches JavaScript /\\s/ anywhere."""
    return _JS_WHITESPACE_RE.search(s) is not None


def js_stringify(value):
    """JSON.stringify for str, int and (nested) lists of them, byte-exact.

    json.dumps already matches JavaScript except that it writes lone
    surrogates raw, where JavaScript writes lowercase \\udxxx escapes.
    """
    out = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        out.encode("utf-8")  # fast check: fails only on surrogates
        return out
    except UnicodeEncodeError:
        pass
    out = _LONE_SURROGATE_RE.sub(lambda m: "\\u%04x" % ord(m.group()), out)
    # Any surrogates left are valid pairs held as two code points: join them.
    return out.encode("utf-16-le", "surrogatepass").decode("utf-16-le")


def note_hash(note):
    """Lowercase hex SHA-256 of JSON.stringify([id, summary, body, tags,
    createdAt(, type)]) for an already validated note."""
    fields = [note["id"], note["summary"], note["body"], note["tags"],
              note["createdAt"]]
    if "type" in note:
        fields.append(note["type"])
    return hashlib.sha256(js_stringify(fields).encode("utf-8")).hexdigest()


def _safe_int_field(obj, name):
    value = as_safe_int(obj[name])
    if value is None:
        raise InvalidNote(name + " must be a non-negative safe integer")
    return value


def validate_note(obj, max_note_bytes=131072):
    """Validate a decoded JSON note and return a new normalised dict with keys
    id, summary, body, tags, type?, createdAt, updatedAt? (in that order).
    Raises InvalidNote with a short reason."""
    if not isinstance(obj, dict):
        raise InvalidNote("note must be an object")
    for name in obj:
        if name not in NOTE_FIELDS:
            raise InvalidNote("unknown note field")
    for name in ("id", "summary", "body", "tags", "createdAt"):
        if name not in obj:
            raise InvalidNote("missing " + name)

    note_id, summary, body, tags = (
        obj["id"], obj["summary"], obj["body"], obj["tags"])
    if not is_valid_id(note_id):
        raise InvalidNote("invalid id")

    if not isinstance(summary, str):
        raise InvalidNote("summary must be a string")
    if not 1 <= js_length(summary) <= _MAX_SUMMARY_LENGTH:
        raise InvalidNote("summary must be 1..500 characters")
    if js_trim(summary) != summary:
        raise InvalidNote("summary has leading or trailing whitespace")
    if any(c in summary for c in _JS_LINE_BREAKS):
        raise InvalidNote("summary must be one line")

    if not isinstance(body, str):
        raise InvalidNote("body must be a string")
    if js_trim(body) != body:
        raise InvalidNote("body has leading or trailing whitespace")
    if len(body.encode("utf-8", "surrogatepass")) > max_note_bytes:
        raise InvalidNote("body is too large")

    if not isinstance(tags, list):
        raise InvalidNote("tags must be a list")
    if len(tags) > _MAX_TAGS:
        raise InvalidNote("too many tags")
    for tag in tags:
        if not isinstance(tag, str):
            raise InvalidNote("tags must be strings")
        if not 1 <= js_length(tag) <= _MAX_TAG_LENGTH:
            raise InvalidNote("tags must be 1..64 characters")
        if "," in tag or has_js_whitespace(tag):
            raise InvalidNote("tags must not contain whitespace or commas")

    note = {"id": note_id, "summary": summary, "body": body,
            "tags": list(tags)}
    if "type" in obj:
        if not isinstance(obj["type"], str) or obj["type"] not in _NOTE_TYPES:
            raise InvalidNote("invalid type")
        note["type"] = obj["type"]
    note["createdAt"] = _safe_int_field(obj, "createdAt")
    if "updatedAt" in obj:
        note["updatedAt"] = _safe_int_field(obj, "updatedAt")
    return note


# -- memory requests -----------------------------------------------------------

class MemoryScope:
    """Where a principal's notes live: one project (project is its id) or the user scope (project
    is None)."""

    __slots__ = ("project",)

    def __init__(self, project=None):
        self.project = project

    def __eq__(self, other):
        return isinstance(other, MemoryScope) and other.project == self.project

    def __hash__(self):
        return hash((MemoryScope, self.project))

    def __repr__(self):
        return "MemoryScope(%r)" % (self.project,)


USER_SCOPE = MemoryScope()


class MemoryChange:
    """One validated change of a commit: a create or update (note is the normalised note), or a
    delete (hash and note are None)."""

    __slots__ = ("id", "hash", "note")

    def __init__(self, note_id, hash_value, note):
        self.id = note_id
        self.hash = hash_value
        self.note = note


class MemoryRequest:
    """A validated memory request: what the route needs of it. Fields a route does not take stay
    None."""

    __slots__ = ("scope", "known_etag", "have", "etag", "changes")

    def __init__(self):
        self.scope = None        # a MemoryScope (snapshot, commit)
        self.known_etag = None   # snapshot: the etag the client holds, or None
        self.have = None         # snapshot, commit: {note id: hash} the client holds, or None
        self.etag = None         # commit: the etag the change is based on (None: no manifest yet)
        self.changes = None      # commit: a list of MemoryChange


_REQUEST_FIELDS = {
    "identity": frozenset(["expectedPrincipal"]),
    "snapshot": frozenset(["expectedPrincipal", "project", "scope", "knownEtag", "have"]),
    "commit": frozenset(["expectedPrincipal", "project", "scope", "etag", "changes", "have"]),
}
_CHANGE_FIELDS = frozenset(["id", "hash", "note"])
_HASH = re.compile(r"[0-9a-f]{64}")
_ID_LINES = re.compile(r"[A-Za-z0-9_-]{1,128}(?:\n[A-Za-z0-9_-]{1,128})*")


def check_memory_envelope(kind, doc, principal):
    """The contract's checks 5 and 6: body shape, unknown fields anywhere, expectedPrincipal."""
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object", "invalid_body")
    refuse_unknown_fields(doc, _REQUEST_FIELDS[kind])
    expected = doc.get("expectedPrincipal")
    if not is_valid_id(expected):
        raise BadRequest("expectedPrincipal must be an id", "invalid_body")
    if expected != principal:
        raise Forbidden("the token belongs to another account", "account_mismatch")


def memory_fields(kind, doc, quota=MEMORY_QUOTA):
    """The route's own fields of an envelope-checked body: scope, then etag or knownEtag, have,
    changes."""
    request = MemoryRequest()
    if kind == "identity":
        return request
    request.scope = memory_scope(doc)
    if kind == "snapshot":
        request.known_etag = _optional_etag(doc, "knownEtag")
    else:
        if "etag" not in doc:
            raise BadRequest("etag is required (null when there is no manifest)", "invalid_body")
        request.etag = _optional_etag(doc, "etag")
    request.have = memory_have(doc, quota)
    if kind == "commit":
        request.changes = memory_changes(doc.get("changes"), quota)
    return request


def refuse_unknown_fields(doc, allowed):
    """400 unknown_field for a field the protocol does not know, in the request, a change or a
    note.

    Changes and notes are only looked into where they are objects: any other shape is the business
    of the later checks (invalid_changes, invalid_note).
    """
    for name in doc:
        if name not in allowed:
            raise BadRequest("unknown field in the request", "unknown_field")
    changes = doc.get("changes")
    if not isinstance(changes, list):
        return
    for change in changes:
        if not isinstance(change, dict):
            continue
        for name in change:
            if name not in _CHANGE_FIELDS:
                raise BadRequest("unknown field in a change", "unknown_field")
        note = change.get("note")
        if isinstance(note, dict):
            for name in note:
                if name not in NOTE_FIELDS:
                    raise BadRequest("unknown field in a note", "unknown_field")


def memory_scope(doc):
    """The MemoryScope of a request: project without scope, or scope "user" without project."""
    if ("project" in doc) == ("scope" in doc):
        raise BadRequest("give either project or scope \"user\"", "invalid_scope")
    if "scope" in doc:
        if doc["scope"] != "user":
            raise BadRequest("the only scope is \"user\"", "invalid_scope")
        return USER_SCOPE
    project = doc["project"]
    if not is_valid_id(project):  # null included: a project that is present must be an id
        raise BadRequest("project must be an id", "invalid_project")
    return MemoryScope(project)


def _optional_etag(doc, name):
    value = doc.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest("%s must be a string or null" % name, "invalid_body")
    return value


def memory_have(doc, quota=MEMORY_QUOTA):
    """The have map of a request ({note id: 64 lowercase hex}), or None when absent."""
    if "have" not in doc:
        return None
    have = doc["have"]
    if not isinstance(have, dict):
        raise BadRequest("have must be an object mapping note ids to hashes", "invalid_have")
    if len(have) > quota["maxNotes"] * 2 + 1000:
        raise BadRequest("have may hold at most maxNotes * 2 + 1000 ids", "invalid_have")
    # Checked as two joined strings rather than key by key: a full `have` has thousands of entries.
    values = list(have.values())
    try:
        joined = "".join(values)
    except TypeError:  # a value that is not a string
        joined = None
    if have and not (joined is not None and set(map(len, values)) == {64} and is_lower_hex(joined)
                     and _valid_id_run(have)):
        raise BadRequest("have must map note ids to 64 lowercase hex hashes", "invalid_have")
    return have


def is_lower_hex(text):
    """True when text holds only 0-9 and a-f (a long run is checked at C speed, unlike a regex)."""
    try:
        data = text.encode("ascii")
    except UnicodeEncodeError:
        return False
    return not data.translate(None, b"0123456789abcdef")


def _valid_id_run(ids):
    """True when every one of many ids is valid, checked as one joined string (no id holds a
    newline)."""
    joined = "\n".join(ids)
    return (_ID_LINES.fullmatch(joined) is not None and joined.count("\n") == len(ids) - 1
            and RESERVED_IDS.isdisjoint(ids))


def memory_changes(changes, quota=MEMORY_QUOTA):
    """The changes of a commit as MemoryChange objects.

    Three passes, so the code does not depend on which entry is wrong: the shape of every change
    (invalid_changes), then every note (invalid_note), then every hash (hash_mismatch).
    """
    if not isinstance(changes, list) or not 1 <= len(changes) <= quota["maxChanges"]:
        raise BadRequest("changes must be a list of 1..maxChanges entries", "invalid_changes")
    seen = set()
    for change in changes:
        _check_change_shape(change, seen)
    notes = []
    for change in changes:
        if change["hash"] is None:
            notes.append(None)
            continue
        try:
            notes.append(validate_note(change["note"], quota["maxNoteBytes"]))
        except InvalidNote as exc:
            raise BadRequest(str(exc), "invalid_note") from None
    result = []
    for change, note in zip(changes, notes):
        # A hash that is not 64 lowercase hex never equals a computed one, so it is a mismatch too.
        if note is not None and note_hash(note) != change["hash"]:
            raise BadRequest("hash is not the hash of the note", "hash_mismatch")
        result.append(MemoryChange(change["id"], change["hash"], note))
    return result


def _check_change_shape(change, seen):
    """400 invalid_changes unless change is {id, hash: string, note} or {id, hash: null}, with a
    new id."""
    def refuse(text):
        raise BadRequest(text, "invalid_changes")

    if not isinstance(change, dict):
        refuse("a change must be an object")
    note_id = change.get("id")
    if not is_valid_id(note_id):
        refuse("a change needs a valid note id")
    if note_id in seen:
        refuse("a note id appears twice in changes")
    seen.add(note_id)
    if "hash" not in change:
        refuse("a change needs a hash (null for a delete)")
    if change["hash"] is None:
        if "note" in change:
            refuse("a delete carries no note")
    elif isinstance(change["hash"], str):
        note = change.get("note")
        if not isinstance(note, dict):
            refuse("a create or update needs a note object")
        if note.get("id") != note_id:
            refuse("the note's id differs from the change's id")
    else:
        refuse("hash must be a string or null")


_DECIMAL = re.compile(r"[0-9]+")
_SIGNED_DECIMAL = re.compile(r"-?[0-9]+")


def parse_cursor(text):
    """The `since` query value: a decimal non-negative safe integer; missing means 0."""
    if text is None:
        return 0
    if not _DECIMAL.fullmatch(text) or len(text) > 16 or int(text) > MAX_SAFE_INTEGER:
        raise BadRequest("since must be a non-negative integer cursor")
    return int(text)


def parse_clamped(text, name, low, high, default):
    """An integer query value clamped to low..high; missing gives default, a non-integer 400."""
    if text is None:
        return default
    if not _SIGNED_DECIMAL.fullmatch(text):
        raise BadRequest("%s must be an integer" % name)
    if len(text) > 18:  # far outside any range: clamp by sign without converting
        return low if text.startswith("-") else high
    return max(low, min(high, int(text)))


def encode_name(value):
    """A file name for an id, reversible and safe on case-insensitive disks.

    Lower-case letters, digits and '-' stay; '_' becomes '__' and an upper-case
    letter X becomes '_x', so 'Alice' and 'alice' stay two different files.
    """
    out = []
    for char in value:
        if char == "_":
            out.append("__")
        elif "A" <= char <= "Z":
            out.append("_" + char.lower())
        else:
            out.append(char)
    return "".join(out)


def decode_name(name):
    """The id that encode_name turned into name."""
    out, i = [], 0
    while i < len(name):
        char = name[i]
        if char == "_" and i + 1 < len(name):
            nxt = name[i + 1]
            out.append("_" if nxt == "_" else nxt.upper())
            i += 2
        else:
            out.append(char)
            i += 1
    return "".join(out)


# -------------------------------------------------------------------------------------------------
# Metrics: what the server counts, for Prometheus
# -------------------------------------------------------------------------------------------------
#
# GET /metrics (with --metrics-token-file) answers in Prometheus' text format, version 0.0.4. A
# series is labelled by route template, method, status class, event kind, token kind or result,
# never by principal, project or token (what each owner stores is counted by owner, for the
# quotas, and never exported). A connection's thread counts its own requests in a Tally
# without a lock; the Metrics take a lock only for what happens once per group commit, token
# failure or memory commit, and when a connection's Tally is folded in as it closes.

REQUEST_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0)
FSYNC_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1)
PUSHES_PER_COMMIT = (1, 2, 4, 8, 16, 32, 64, 128)
METRIC_METHODS = frozenset(["GET", "HEAD", "POST"])
# The status classes a route's requests are counted under from the first scrape, at 0: a query or
# an alert on one (an error ratio, say) then has its series before the first such request.
EXPECTED_STATUS_CLASSES = (2, 4, 5)
_bucket = bisect.bisect_left  # (an observation of a bucket's bound is in it: le)
_FIRST_BOUND = REQUEST_SECONDS[0]
_SUM = len(REQUEST_SECONDS) + 1  # where a Tally's row keeps the sum of its durations


class Histogram:
    """Observations counted by bucket (an upper bound each, then +Inf), with their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value):
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add(self, other):
        for i, count in enumerate(other.counts):
            self.counts[i] += count
        self.sum += other.sum

    def add_row(self, row):
        """Add a Tally's row: counts by bucket, then their sum."""
        for i, count in enumerate(row[:-1]):
            self.counts[i] += count
        self.sum += row[-1]

    def copy(self):
        twin = Histogram(self.bounds)
        twin.add(self)
        return twin


class Tally(dict):
    """Requests counted by one connection's own thread, without a lock: a row for each (route,
    method, status) met, of their durations' counts by bucket of REQUEST_SECONDS (then +Inf) and
    their sum (at _SUM, last). It remembers the row of the request before: a connection's next
    request is mostly like its last, and then costs three comparisons and two additions. routes:
    the paths counted by name (the app's routes, Metrics.expect), any other as "other"."""

    __slots__ = ("routes", "path", "method", "status", "last")

    def __init__(self, routes=frozenset()):
        super().__init__()
        self.routes = routes
        self.path = self.method = self.status = self.last = None

    def row(self, path, method, status):
        """The row of a request unlike the one before (remembered for the next): by route
        template and method, a path or method of no route counted as "other" (so a client makes
        no new series)."""
        row = self.get((path, method, status))
        if row is None:
            key = (path if path in self.routes else "other",
                   method if method in METRIC_METHODS else "other", status)
            row = self.get(key)
            if row is None:
                row = self[key] = [0] * (len(REQUEST_SECONDS) + 1) + [0.0]
        self.path, self.method, self.status, self.last = path, method, status, row
        return row

    def count(self, path, method, status, seconds):
        if path == self.path and status == self.status and method == self.method:
            row = self.last
        else:
            row = self.row(path, method, status)
        row[0 if seconds <= _FIRST_BOUND else _bucket(REQUEST_SECONDS, seconds)] += 1
        row[_SUM] += seconds

    def add(self, other):
        """Count other's requests here too (its thread may count on meanwhile: its rows are
        copied as they are)."""
        for key, row in list(other.items()):
            mine = self.get(key)
            if mine is None:
                self[key] = list(row)
            else:
                for i, value in enumerate(list(row)):
                    mine[i] += value


class Metrics:
    """What the server counts since it started (see the section's comment)."""

    def __init__(self, clock=time.time):
        self.lock = threading.Lock()
        self.started = clock()
        self.closed = Tally()                  # the requests of connections that have closed
        self.tallies = {}                      # id -> the Tally of an open connection
        self.counters = collections.Counter()  # (name, label value) -> count
        self.fsyncs = Histogram(FSYNC_SECONDS)
        self.commits = Histogram(PUSHES_PER_COMMIT)
        self.gauges = []                       # (name, help, read), read at each scrape
        self.expected = set()                  # (route, method) counted at 0 before any request
        self.routes = set()                    # the routes of expected: counted by name

    def gauge(self, name, text, read):
        """A gauge whose value read() gives at each scrape."""
        self.gauges.append((name, text, read))

    def expect(self, route, method):
        """Show route's requests by method, and their durations, from the first scrape: at 0 for
        each of EXPECTED_STATUS_CLASSES (Prometheus cannot tell an absent series from no data)."""
        with self.lock:
            self.expected.add((route, method))
            self.routes.add(route)

    def add(self, name, label=None, amount=1):
        with self.lock:
            self.counters[name, label] += amount

    def stored(self, principal):
        """The bytes principal stores: their own feeds and their memory (a team's feeds count
        against no one)."""
        with self.lock:
            return (self.counters["feed_bytes", ("u", principal)]
                    + self.counters["memory_bytes", principal])

    def total(self, name):
        """The sum of a counter over its labels (feed_bytes, memory_bytes: every owner's)."""
        with self.lock:
            return sum(count for (key, _), count in self.counters.items() if key == name)

    def group_commit(self, pushes, records, sessions, seconds):
        """One group commit: the pushes it made durable, its events by kind, its fsync's time."""
        with self.lock:
            self.commits.observe(pushes)
            self.fsyncs.observe(seconds)
            self.counters["events", "record"] += records
            self.counters["events", "session"] += sessions

    def open_tally(self):
        tally = Tally(self.routes)
        with self.lock:
            self.tallies[id(tally)] = tally
        return tally

    def close_tally(self, tally):
        with self.lock:
            del self.tallies[id(tally)]
            self.closed.add(tally)

    def requests(self):
        """The requests counted so far, open connections' too: (counts by (route, method, status
        class), Histograms of durations by route)."""
        every = Tally()
        with self.lock:
            every.add(self.closed)
            tallies = list(self.tallies.values())
            expected = list(self.expected)
        for tally in tallies:
            every.add(tally)
        counts = {(route, method, status): 0
                  for route, method in expected for status in EXPECTED_STATUS_CLASSES}
        durations = {route: Histogram(REQUEST_SECONDS) for route, _ in expected}
        for (route, method, status), row in every.items():
            key = (route, method, status // 100)
            counts[key] = counts.get(key, 0) + sum(row[:-1])
            histogram = durations.get(route)
            if histogram is None:
                histogram = durations[route] = Histogram(REQUEST_SECONDS)
            histogram.add_row(row)
        return counts, durations


class Exposition:
    """Prometheus' text format, version 0.0.4, written metric by metric."""

    def __init__(self):
        self.lines = []

    def metric(self, name, kind, text, samples):
        """samples: [(labels, value)], labels a tuple of (name, value) pairs."""
        self.lines.append("# HELP %s %s" % (name, text))
        self.lines.append("# TYPE %s %s" % (name, kind))
        for labels, value in samples:
            self.lines.append("%s%s %s" % (name, _labels(labels), _number(value)))

    def histogram(self, name, text, histograms):
        """histograms: [(labels, Histogram)]."""
        self.lines.append("# HELP %s %s" % (name, text))
        self.lines.append("# TYPE %s histogram" % name)
        for labels, histogram in histograms:
            cumulative = 0
            for bound, count in zip(histogram.bounds + (float("inf"),), histogram.counts):
                cumulative += count
                self.lines.append("%s_bucket%s %d" % (
                    name, _labels(labels + (("le", _number(bound)),)), cumulative))
            self.lines.append("%s_sum%s %s" % (name, _labels(labels), _number(histogram.sum)))
            self.lines.append("%s_count%s %d" % (name, _labels(labels), cumulative))

    def text(self):
        return ("\n".join(self.lines) + "\n").encode("utf-8")


def _labels(labels):
    if not labels:
        return ""
    return "{%s}" % ",".join('%s="%s"' % (name, str(value).replace("\\", "\\\\").replace(
        '"', '\\"').replace("\n", "\\n")) for name, value in labels)


def _number(value):
    if value == float("inf"):
        return "+Inf"
    if isinstance(value, int):
        return "%d" % value
    return repr(float(value))


def process_samples(started):
    """The usual process_ metrics: (name, kind, help, value) of those this machine can tell
    (from /proc where there is one; else the CPU time, threads, and started, the time the
    Metrics were made)."""
    samples = []
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        samples.append(("process_cpu_seconds_total", "counter", "User and system CPU time spent.",
                        (int(fields[11]) + int(fields[12])) / float(ticks)))
        samples.append(("process_threads", "gauge", "Threads of the process.", int(fields[17])))
        samples.append(("process_resident_memory_bytes", "gauge", "Resident memory size.",
                        int(fields[21]) * os.sysconf("SC_PAGE_SIZE")))
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        samples.append(("process_start_time_seconds", "gauge",
                        "Start time of the process since the Unix epoch.",
                        boot + int(fields[19]) / float(ticks)))
        samples.append(("process_open_fds", "gauge", "Open file descriptors.",
                        len(os.listdir("/proc/self/fd"))))
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        if resource is not None:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            samples = [("process_cpu_seconds_total", "counter", "User and system CPU time spent.",
                        usage.ru_utime + usage.ru_stime)]
        samples.append(("process_threads", "gauge", "Threads of the process.",
                        threading.active_count()))
        samples.append(("process_start_time_seconds", "gauge",
                        "Start time of the process since the Unix epoch.", started))
    return samples


def exposition(metrics):
    """The whole scrape, as bytes."""
    out = Exposition()
    out.metric("oharness_sync_info", "gauge", "The server's version and sync protocol.",
               [((("version", __version__), ("protocol", "1")), 1)])
    counts, durations = metrics.requests()
    out.metric("oharness_sync_http_requests_total", "counter",
               "Requests answered, by route template, method and status class.",
               [((("route", route), ("method", method), ("status", "%dxx" % status)), count)
                for (route, method, status), count in sorted(counts.items())])
    out.histogram("oharness_sync_http_request_duration_seconds",
                  "Time from a request's head to its response, by route template (a long-poll's "
                  "wait included).", [((("route", route),), histogram)
                                      for route, histogram in sorted(durations.items())])
    with metrics.lock:
        counters = dict(metrics.counters)
        fsyncs, commits = metrics.fsyncs.copy(), metrics.commits.copy()
    labelled = [("events", "oharness_sync_events_appended_total",
                 "Events appended to feeds, by kind.", "kind", ("record", "session")),
                ("token_failures", "oharness_sync_token_checks_failed_total",
                 "Bearer tokens that failed their check, by token kind.", "kind",
                 ("local", "jwt", "supabase", "other")),
                ("token_throttled", "oharness_sync_token_checks_throttled_total",
                 "Tokens refused unchecked (429) as their client failed too many lately, by kind.",
                 "kind", ("jwt", "supabase")),
                ("memory_commits", "oharness_sync_memory_commits_total",
                 "Memory commits, by result.", "result", ("ok", "conflict", "quota"))]
    for key, name, text, label, values in labelled:
        out.metric(name, "counter", text, [(((label, value),), counters.get((key, value), 0))
                                           for value in values])
    out.histogram("oharness_sync_fsync_duration_seconds",
                  "Time a group commit's write and fsync took.", [((), fsyncs)])
    out.histogram("oharness_sync_group_commit_pushes", "Pushes made durable by one group commit.",
                  [((), commits)])
    for key, name, text in (("woken", "oharness_sync_long_polls_woken_total",
                             "Parked long-polls woken by an event."),
                            ("refused", "oharness_sync_connections_refused_total",
                             "Connections refused with 503 at the connection cap or at the "
                             "cap per address."),
                            ("compactions", "oharness_sync_compactions_total",
                             "Feeds compacted in the background.")):
        out.metric(name, "counter", text, [((), counters.get((key, None), 0))])
    for name, text, read in metrics.gauges:
        out.metric(name, "gauge", text, [((), read())])
    for name, kind, text, value in process_samples(metrics.started):
        out.metric(name, kind, text, [((), value)])
    return out.text()


# -------------------------------------------------------------------------------------------------
# Authentication: one small verifier per token kind
# -------------------------------------------------------------------------------------------------

class Identity:
    """Who a verified token speaks for: a principal id, its teams, and whether it is anonymous."""
    __slots__ = ("principal", "teams", "anonymous")

    def __init__(self, principal, teams=(), anonymous=False):
        self.principal = principal
        self.teams = frozenset(teams)
        self.anonymous = anonymous

    def __eq__(self, other):
        return isinstance(other, Identity) and (self.principal, self.teams, self.anonymous) == (
            other.principal, other.teams, other.anonymous)

    def __repr__(self):
        return "Identity(%r, %r, %r)" % (self.principal, sorted(self.teams), self.anonymous)


_BEARER = re.compile(r"Bearer +([\x21-\x7e]+) *", re.IGNORECASE)


def bearer_token(header):
    """The token of an `Authorization: Bearer <token>` header; AuthError when there is none."""
    match = _BEARER.fullmatch(header or "")
    if match is None:
        raise AuthError("missing or malformed bearer token")
    return match.group(1)


def token_hash(token):
    """Lowercase hex SHA-256 of a token: the only form in which tokens are stored."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


_TOKEN_ID = re.compile(r"[0-9a-f]{12}")


def split_local_token(token):
    """(token id, whole token) of a local token `ohs_<12 hex id>_<secret>`, or None."""
    if not token.startswith(LOCAL_TOKEN_PREFIX):
        return None
    token_id, sep, secret = token[len(LOCAL_TOKEN_PREFIX):].partition("_")
    if not sep or _TOKEN_ID.fullmatch(token_id) is None or len(secret) < 16:
        return None
    return token_id


def out_of_fds(exc):
    """Whether an OSError says the process (or system) has no file descriptor left: the file it
    was opening is not at fault."""
    return exc.errno in (errno.EMFILE, errno.ENFILE)


class LocalTokenVerifier:
    """Verifies opaque tokens issued by `token issue` against the hashed token file.

    The file is looked at (one stat) at most once a second, so a running server
    honours new and revoked tokens without a restart. A file that cannot be read
    or parsed keeps the last good set in force: a 401 must never be spurious.
    But a changed file that cannot be opened for want of a file descriptor may have
    revoked a token: until it is read, every local token is answered 503 (AuthUnavailable).
    """

    def __init__(self, tokens, log, clock=time.time, monotonic=time.monotonic):
        self.tokens = tokens
        self.clock = clock          # expiry
        self.monotonic = monotonic  # the once-a-second looks
        self.log = log
        self._lock = threading.Lock()
        self._checked = float("-inf")
        self._version = None
        self._bad_version = None   # the stamp of the damaged file last logged
        self._out_of_fds = False   # the file changed, and could not be opened for want of an fd
        self._records = {}
        self.generation = 0        # token sets installed: it changes when the tokens in force do
        # Read now, not at the first request: if the file breaks before that, the set in force from
        # the start is the last good one. (The first request still looks at the file again, as
        # ever.)
        self._reload()

    def refresh(self):
        """Look at the token file, if the last look is a second old or more."""
        now = self.monotonic()
        if now - self._checked < TOKEN_RELOAD_SECONDS:
            return  # the file was looked at less than a second ago, and what it held is in force
        with self._lock:
            if now - self._checked < TOKEN_RELOAD_SECONDS:
                return
            try:
                self._reload()
            finally:
                # Only now: a request that skips the lock must find the look finished, not begun.
                self._checked = now

    def _reload(self):
        version = self.tokens.version()
        if version == self._version and not self._out_of_fds:
            return
        try:
            records = self.tokens.read()
        except OSError as exc:
            if not out_of_fds(exc):
                self._keep_records(version, exc)
            elif not self._out_of_fds:  # read again at every look; logged once
                self._out_of_fds = True
                self.log("cannot open the token file %s now (%s): local tokens are answered 503 "
                         "until it is read" % (self.tokens.path, reason(exc)))
            return
        except ValueError as exc:
            self._keep_records(version, exc)
            return
        self._bad_version = None
        self._install(records, version)

    def _keep_records(self, version, exc):
        """A changed file that cannot be read or parsed: what was in force stays. It is read again
        at every look (a chmod mends it without a new stamp), but logged once a version."""
        self._out_of_fds = False  # (it could be opened)
        if version != self._bad_version:
            self.log("token file %s unreadable, keeping the previous tokens: %s" % (
                self.tokens.path, reason(exc)))
            self._bad_version = version

    def _install(self, records, version):
        # Each token's Identity is made here, once, not on every request.
        if self._out_of_fds:
            self.log("read the token file %s again" % self.tokens.path)
            self._out_of_fds = False
        self._records = {record["id"]: (record, Identity(record["principal"],
                                                         record.get("teams", ())))
                         for record in records}
        self._version = version
        self.generation += 1

    def reload(self):
        """Read the token file now, whatever its stamp (SIGHUP); the number of tokens in force.
        OSError or ValueError when it cannot be read: the tokens last read stay in force (and it is
        not logged again), unless it could not be opened for want of a file descriptor
        (out_of_fds): then local tokens are answered 503 until it is read."""
        with self._lock:
            version = self.tokens.version()
            try:
                records = self.tokens.read()
            except (OSError, ValueError) as exc:
                if isinstance(exc, OSError) and out_of_fds(exc):
                    self._out_of_fds = True
                else:
                    self._bad_version = version
                raise
            self._bad_version = None
            self._install(records, version)
            self._checked = self.monotonic()
            return len(self._records)

    def verify(self, token):
        token_id = split_local_token(token)
        if token_id is None:
            raise AuthError("unknown token")
        self.refresh()
        if self._out_of_fds:
            raise AuthUnavailable("the token file cannot be opened now: out of file descriptors")
        record, identity = self._records.get(token_id, (None, None))
        presented = token_hash(token)
        stored = record["hash"] if record else "0" * 64
        if not hmac.compare_digest(presented, stored) or record is None:
            raise AuthError("unknown or revoked token")
        expires = record.get("expires")
        if expires is not None and self.clock() * 1000 >= expires:
            raise AuthError("token expired")
        return identity


# -- JWTs: HS256 with a shared secret, RS256 and ES256 against a JWKS -------
#
# Error messages never contain the token, and exceptions raised while reading
# it are not chained (`from None`), so no part of it reaches a log.


_B64URL_PATTERN = re.compile(r"[A-Za-z0-9_-]*")


def b64url_encode(data):
    """Base64url without padding, as JWTs and JWKs write it."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text):
    """Strict base64url: no padding, no other characters, canonical form only. Raises
    ValueError."""
    if not isinstance(text, str) or _B64URL_PATTERN.fullmatch(text) is None or len(text) % 4 == 1:
        raise ValueError("malformed base64url")
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if b64url_encode(data) != text:  # unused low bits set: not the one canonical spelling
        raise ValueError("malformed base64url")
    return data


def _json_object(data, what):
    """Parse UTF-8 JSON that must be an object; AuthError otherwise."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise AuthError("malformed token %s" % what) from None
    if not isinstance(value, dict):
        raise AuthError("token %s is not a JSON object" % what)
    return value


def decode_jwt(token):
    """Split a compact JWT into (header, payload, signing_input, signature) without verifying
    it."""
    if not isinstance(token, str) or not token:
        raise AuthError("missing bearer token")
    if len(token) > MAX_TOKEN_LENGTH:
        raise AuthError("bearer token too long")
    parts = token.split(".")
    if len(parts) != 3:
        raise AuthError("malformed token: expected three segments")
    try:
        header_bytes = b64url_decode(parts[0])
        payload_bytes = b64url_decode(parts[1])
        signature = b64url_decode(parts[2])
    except ValueError:
        raise AuthError("malformed token: bad base64url") from None
    header = _json_object(header_bytes, "header")
    payload = _json_object(payload_bytes, "payload")
    signing_input = (parts[0] + "." + parts[1]).encode("ascii")
    return header, payload, signing_input, signature


# ---- signature algorithms -------------------------------------------------

def verify_hs256(secret, signing_input, signature):
    """HMAC-SHA256 check, constant time."""
    expected = hmac.new(secret, signing_input, hashlib.sha256).digest()
    return hmac.compare_digest(expected, signature)


# DER prefix of DigestInfo{sha256, digest} (RFC 8017, section 9.2, note 1).
SHA256_DIGEST_INFO = bytes.fromhex("3031300d060960864801650304020105000420")
RSA_MIN_BITS = 2048
RSA_MAX_BITS = 4096


def verify_rs256(n, e, signing_input, signature):
    """RSASSA-PKCS1-v1_5 with SHA-256 (RFC 8017, 8.2.2): rebuild the full encoding and compare."""
    if not RSA_MIN_BITS <= n.bit_length() <= RSA_MAX_BITS:
        return False
    size = (n.bit_length() + 7) // 8
    if len(signature) != size:
        return False
    s = int.from_bytes(signature, "big")
    if s >= n:
        return False
    encoded = pow(s, e, n).to_bytes(size, "big")
    digest_info = SHA256_DIGEST_INFO + hashlib.sha256(signing_input).digest()
    expected = b"\x00\x01" + b"\xff" * (size - 3 - len(digest_info)) + b"\x00" + digest_info
    return hmac.compare_digest(encoded, expected)


# NIST P-256 (FIPS 186-4, D.1.2.3); a = -3.
P256_P = 0xffffffff00000001000000000000000000000000ffffffffffffffffffffffff
P256_A = P256_P - 3
P256_B = 0x5ac635d8aa3a93e7b3ebbd55769886bc651d06b0cc53b0f63bce3c3e27d2604b
P256_N = 0xffffffff00000000ffffffffffffffffbce6faada7179e84f3b9cac2fc632551
P256_G = (0x6b17d1f2e12c4247f8bce6e563a440f277037d812deb33a0f4a13945d898c296,
          0x4fe342e2fe1a7f9b8ee7eb4a7c0f9e162bce33576b315ececbb6406837bf51f5)


def p256_on_curve(x, y):
    """True if (x, y) is a point of P-256 (coordinates reduced, not the point at infinity)."""
    if not (0 <= x < P256_P and 0 <= y < P256_P):
        return False
    return (y * y - (x * x * x + P256_A * x + P256_B)) % P256_P == 0


# Points in Jacobian coordinates (X, Y, Z) stand for (X/Z^2, Y/Z^3); Z == 0 is infinity.
_INFINITY = (1, 1, 0)


def _jacobian_double(point):
    x, y, z = point
    p = P256_P
    if z == 0 or y == 0:
        return _INFINITY
    delta = z * z % p
    gamma = y * y % p
    beta = x * gamma % p
    alpha = 3 * (x - delta) * (x + delta) % p     # uses a = -3
    x3 = (alpha * alpha - 8 * beta) % p
    z3 = ((y + z) * (y + z) - gamma - delta) % p
    y3 = (alpha * (4 * beta - x3) - 8 * gamma * gamma) % p
    return (x3, y3, z3)


def _jacobian_add(first, second):
    x1, y1, z1 = first
    x2, y2, z2 = second
    p = P256_P
    if z1 == 0:
        return second
    if z2 == 0:
        return first
    z1z1 = z1 * z1 % p
    z2z2 = z2 * z2 % p
    u1 = x1 * z2z2 % p
    u2 = x2 * z1z1 % p
    s1 = y1 * z2 * z2z2 % p
    s2 = y2 * z1 * z1z1 % p
    if u1 == u2:
        return _jacobian_double(first) if s1 == s2 else _INFINITY
    h = (u2 - u1) % p
    r = (s2 - s1) % p
    h2 = h * h % p
    h3 = h * h2 % p
    u1h2 = u1 * h2 % p
    x3 = (r * r - h3 - 2 * u1h2) % p
    y3 = (r * (u1h2 - x3) - s1 * h3) % p
    z3 = h * z1 * z2 % p
    return (x3, y3, z3)


def _jacobian_multiply(k, point):
    result = _INFINITY
    for bit in bin(k)[2:]:
        result = _jacobian_double(result)
        if bit == "1":
            result = _jacobian_add(result, point)
    return result


def verify_es256(x, y, signing_input, signature):
    """ECDSA P-256 with SHA-256; the JOSE signature is r || s, 32 bytes each."""
    if len(signature) != 64 or not p256_on_curve(x, y):
        return False
    r = int.from_bytes(signature[:32], "big")
    s = int.from_bytes(signature[32:], "big")
    if not (1 <= r < P256_N and 1 <= s < P256_N):
        return False
    e = int.from_bytes(hashlib.sha256(signing_input).digest(), "big")
    w = pow(s, -1, P256_N)
    u1 = e * w % P256_N
    u2 = r * w % P256_N
    generator = (P256_G[0], P256_G[1], 1)
    point = _jacobian_add(_jacobian_multiply(u1, generator), _jacobian_multiply(u2, (x, y, 1)))
    px, _, pz = point
    if pz == 0:
        return False
    affine_x = px * pow(pz * pz % P256_P, -1, P256_P) % P256_P
    return affine_x % P256_N == r


# ---- JWKS -----------------------------------------------------------------

class RsaKey:
    """An RSA public key from a JWKS, usable for RS256."""
    token_alg = "RS256"

    def __init__(self, kid, n, e, alg=None):
        self.kid = kid
        self.n = n
        self.e = e
        self.alg = alg

    def verify(self, signing_input, signature):
        return verify_rs256(self.n, self.e, signing_input, signature)


class EcKey:
    """A P-256 public key from a JWKS, usable for ES256."""
    token_alg = "ES256"

    def __init__(self, kid, x, y, alg=None):
        self.kid = kid
        self.x = x
        self.y = y
        self.alg = alg

    def verify(self, signing_input, signature):
        return verify_es256(self.x, self.y, signing_input, signature)


def _b64url_uint(value, length=None):
    data = b64url_decode(value)
    if length is not None and len(data) != length:
        raise ValueError("wrong coordinate length")
    return int.from_bytes(data, "big")


def _parse_jwk(jwk):
    """One JWKS entry as RsaKey or EcKey; None for a key this server does not use."""
    if not isinstance(jwk, dict) or not isinstance(jwk.get("kid"), str):
        return None
    if jwk.get("use", "sig") != "sig":
        return None
    alg = jwk.get("alg")
    if alg is not None and not isinstance(alg, str):
        return None
    try:
        if jwk.get("kty") == "RSA":
            n = _b64url_uint(jwk["n"])
            e = _b64url_uint(jwk["e"])
            if RSA_MIN_BITS <= n.bit_length() <= RSA_MAX_BITS and e >= 3 and e % 2 == 1:
                return RsaKey(jwk["kid"], n, e, alg)
        elif jwk.get("kty") == "EC" and jwk.get("crv") == "P-256":
            x = _b64url_uint(jwk["x"], 32)
            y = _b64url_uint(jwk["y"], 32)
            if p256_on_curve(x, y):
                return EcKey(jwk["kid"], x, y, alg)
    except (KeyError, ValueError):
        pass
    return None


def parse_jwks(obj):
    """{"keys": [...]} -> {kid: RsaKey or EcKey}. Unusable keys are skipped; the first of a
    repeated kid wins.

    Raises ValueError when obj is not a JWKS at all.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("keys"), list):
        raise ValueError("not a JWKS: expected an object with a \"keys\" array")
    keys = {}
    for jwk in obj["keys"]:
        key = _parse_jwk(jwk)
        if key is not None and key.kid not in keys:
            keys[key.kid] = key
    return keys


def read_jwks_file(path):
    """Parse a JWKS file. Raises OSError or ValueError."""
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        obj = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return parse_jwks(obj)


def fetch_jwks_url(url, timeout):
    """GET and parse a JWKS. Raises OSError, ValueError or http.client.HTTPException."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read(MAX_RESPONSE_BYTES + 1)
    if len(body) > MAX_RESPONSE_BYTES:
        raise ValueError("JWKS too large")
    return parse_jwks(json.loads(body.decode("utf-8")))


class JwksSource:
    """The public keys tokens may be signed with, from a file (path=) or a URL (url=).

    A file is read at once (so a bad --jwks-file stops start-up) and re-read when
    its mtime changes: looked at once a second at most, and at once for a token
    whose key it has not got. A URL is fetched on first use, refetched on an
    unknown kid at most once a minute, and refreshed on use once its keys are
    JWKS_MAX_AGE old. A failed or unparsable re-read keeps the last good key set,
    and is logged.

    A token whose key is not in the set is only refused (AuthError, a 401) when the
    set was read well since the token was first seen: a file looked at again, a URL
    fetched again (for it or for another token). Otherwise (the last fetch or re-read
    failed, or a URL was fetched less than a minute ago, perhaps before the key was
    published) it cannot be judged yet: AuthUnavailable, not a 401, which would stop
    the client's mirror for a token that may well be good.
    """

    def __init__(self, log, path=None, url=None, timeout=5.0, clock=time.monotonic):
        if (path is None) == (url is None):
            raise ValueError("give exactly one of path and url")
        self.path = path
        self.url = url
        self.timeout = timeout
        self.clock = clock
        self.log = log
        self.keys = {}
        self._lock = threading.Lock()
        self._last_load = None     # clock() of the last fetch or file check, good or bad
        self._loaded_at = None     # clock() of the last good fetch
        self._failed = False       # the last fetch or re-read failed
        self._looks = 0            # fetches and file checks so far
        # (kid, alg) -> self._looks when it first got a 503 for want of a fetch
        self._unknown = OrderedDict()
        self._file_stamp = None
        if path is not None:
            self._file_stamp = self._stamp()
            self.keys = read_jwks_file(path)
            self._last_load = clock()

    def key(self, kid, alg):
        """The key for a token's kid and alg; AuthError if there is none or it is for another
        alg."""
        with self._lock:
            looks = self._looks
            self._refresh_if_due()
            key = self._pick(kid, alg)
            if key is None and self._looks == looks:  # not looked at for this token yet
                if self.path is not None:
                    # A stat: its key may have been written this second (while the file is
                    # unreadable, a 503 anyway: no read per request).
                    if not self._failed:
                        self._check_file()
                elif self._may_fetch():
                    self._fetch()
                key = self._pick(kid, alg)
            read_for_it, failed = self._looks != looks, self._failed
            if key is None and not failed and not read_for_it:
                # Asked for before: a good fetch since then, whoever's request made it, settles it.
                first = self._unknown.setdefault((kid, alg), self._looks)
                read_for_it = self._looks > first
                if len(self._unknown) > JWKS_UNKNOWN_KIDS:
                    self._unknown.popitem(last=False)
            elif key is not None and self._unknown:
                # Published since: a later removal starts afresh.
                self._unknown.pop((kid, alg), None)
        if key is None and failed:
            raise AuthUnavailable("its signing keys cannot be read")
        if key is None and not read_for_it:
            raise AuthUnavailable("its key is not among the signing keys fetched less than "
                                  "%d s ago" % JWKS_REFETCH_INTERVAL)
        if key is None:
            raise AuthError("no signing key for this token", lasting=False)
        if key.token_alg != alg or (key.alg is not None and key.alg != alg):
            raise AuthError("token alg does not match its key")
        return key

    def _pick(self, kid, alg):
        if kid is not None:
            return self.keys.get(kid)
        candidates = [key for key in self.keys.values() if key.token_alg == alg]
        return candidates[0] if len(candidates) == 1 else None

    def _may_fetch(self):
        return self._last_load is None or self.clock() - self._last_load >= JWKS_REFETCH_INTERVAL

    def _refresh_if_due(self):
        now = self.clock()
        if self.path is not None:
            if now - self._last_load >= JWKS_FILE_CHECK_INTERVAL:
                self._check_file()
        elif self._last_load is None:  # first use
            self._fetch()
        elif (self._loaded_at is not None and now - self._loaded_at >= JWKS_MAX_AGE
                and self._may_fetch()):
            self._fetch()

    def _fetch(self):
        self._last_load = self.clock()
        self._looks += 1
        try:
            keys = fetch_jwks_url(self.url, self.timeout)
        except Exception as exc:  # any failure of the key service: keep the last good keys
            self._failed = True
            self.log("cannot fetch the JWKS from %s (%s: %s); keeping the last good keys (%d), "
                     "trying again in %d s at the earliest"
                     % (self.url, type(exc).__name__, exc, len(self.keys), JWKS_REFETCH_INTERVAL))
            return
        self.keys = keys
        self._loaded_at = self._last_load
        self._failed = False

    def _stamp(self):
        info = os.stat(self.path)
        # The inode and ctime too: a file renamed into place may have the old one's size and mtime
        # (cp -p, rsync -t, a Nix store path's mtime of 1), and its keys would never be read.
        return (info.st_dev, info.st_ino, info.st_ctime_ns, info.st_mtime_ns, info.st_size)

    def reload(self):
        """Read the JWKS file now, whatever its stamp (SIGHUP); the number of keys. OSError or
        ValueError when it cannot be read: the last good keys stay in force, as when a look finds
        it unreadable."""
        with self._lock:
            self._check_file(forced=True)
            return len(self.keys)

    def _check_file(self, forced=False):
        """Read the file again if its stamp has changed (or its last read failed). forced: read it
        anyway, and raise a failure instead of logging it."""
        self._last_load = self.clock()
        self._looks += 1
        try:
            stamp = self._stamp()
            if stamp == self._file_stamp and not forced:
                return
            self._file_stamp = stamp
            self.keys = read_jwks_file(self.path)
            self._failed = False
        except (OSError, ValueError) as exc:  # read_jwks_file turns a RecursionError into one
            # Once, not at every look while it stays unreadable.
            if not self._failed and not forced:
                self.log("cannot re-read the JWKS file %s (%s); keeping the last good keys (%d)"
                         % (self.path, exc, len(self.keys)))
            self._failed = True
            # Read it again at the next look even if its stamp stays the same: a chmod, or a file
            # moved away and back, makes it readable without changing its mtime or size.
            self._file_stamp = None
            if forced:
                raise


def read_secret_file(path):
    """The HS256 secret: the file's bytes less one trailing newline. Raises ValueError if empty."""
    with open(path, "rb") as handle:
        secret = handle.read()
    if secret.endswith(b"\r\n"):
        secret = secret[:-2]
    elif secret.endswith(b"\n"):
        secret = secret[:-1]
    if not secret:
        raise ValueError("the JWT secret file is empty")
    return secret


# ---- verified-token cache ---------------------------------------------------

class TokenCache:
    """SHA-256 of a token -> (value, expires_at), least recently used dropped first. The value is
    the Identity of a verified token, or the refusal of a failed one (GuardedVerifier)."""

    def __init__(self, max_entries=TOKEN_CACHE_SIZE):
        self.max_entries = max_entries
        self._entries = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def digest(token):
        return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()

    def get(self, token, now):
        """The cached value, or None if absent or expired at `now`."""
        digest = self.digest(token)
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            value, expires_at = entry
            if now >= expires_at:
                del self._entries[digest]
                return None
            self._entries.move_to_end(digest)
            return value

    def put(self, token, value, expires_at):
        digest = self.digest(token)
        with self._lock:
            self._entries[digest] = (value, expires_at)
            self._entries.move_to_end(digest)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self):
        return len(self._entries)


# ---- JWT verifier -----------------------------------------------------------

def _number_claim(payload, name):
    """A numeric claim (exp, nbf) or None if absent; AuthError for any other type."""
    if name not in payload:
        return None
    value = payload[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AuthError("token %s is not a number" % name)
    if isinstance(value, float) and not math.isfinite(value):  # JSON ints are always finite
        raise AuthError("token %s is not a number" % name)
    return value


def _audience_matches(aud, audience):
    if isinstance(aud, str):
        return aud == audience
    if isinstance(aud, list) and all(isinstance(item, str) for item in aud):
        return audience in aud
    return False


class JwtVerifier:
    """Verifies bearer JWTs: HS256 with `secret` (bytes), RS256/ES256 with `jwks` (a JwksSource).

    `issuer` and `audience`, when given, must match the token's iss and aud.
    `clock` gives the wall-clock time in seconds (for exp and nbf).
    """

    def __init__(self, secret=None, jwks=None, issuer=None, audience=None, clock=time.time):
        if secret is None and jwks is None:
            raise ValueError("a JWT verifier needs a secret, a JWKS, or both")
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise ValueError("the JWT secret must be non-empty bytes")
        self.secret = secret
        self.jwks = jwks
        self.issuer = issuer
        self.audience = audience
        self.clock = clock
        self.cache = TokenCache()

    def cached(self, token):
        """The Identity of a token verified lately (no signature math), or None."""
        return self.cache.get(token, self.clock())

    def verify(self, token):
        """The Identity a token speaks for; AuthError if it is not a valid token now."""
        if not isinstance(token, str) or not token:
            raise AuthError("missing bearer token")
        identity = self.cached(token)
        if identity is not None:
            return identity
        now = self.clock()
        header, payload, signing_input, signature = decode_jwt(token)
        self._check_signature(header, signing_input, signature)
        identity, expires_at = self._check_claims(payload, now)
        self.cache.put(token, identity, expires_at)
        return identity

    def _check_signature(self, header, signing_input, signature):
        alg = header.get("alg")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise AuthError("token kid is not a string")
        if "crit" in header:
            raise AuthError("token has critical header extensions")
        if alg == "HS256":
            if self.secret is None:
                raise AuthError("HS256 tokens are not accepted")
            valid = verify_hs256(self.secret, signing_input, signature)
        elif alg in ("RS256", "ES256"):
            if self.jwks is None:
                raise AuthError("%s tokens are not accepted" % alg)
            valid = self.jwks.key(kid, alg).verify(signing_input, signature)
        else:
            raise AuthError("unsupported token alg")
        if not valid:
            raise AuthError("bad token signature")

    def _check_claims(self, payload, now):
        """(Identity, cache expiry) from verified claims; AuthError if they do not hold now."""
        exp = _number_claim(payload, "exp")
        nbf = _number_claim(payload, "nbf")
        if exp is not None and now >= exp + LEEWAY_SECONDS:
            raise AuthError("token expired")
        if nbf is not None and now + LEEWAY_SECONDS < nbf:
            raise AuthError("token not yet valid", lasting=False)
        if self.issuer is not None and payload.get("iss") != self.issuer:
            raise AuthError("token issuer not accepted")
        if self.audience is not None and not _audience_matches(payload.get("aud"), self.audience):
            raise AuthError("token audience not accepted")
        principal = payload.get("sub")
        if not is_valid_id(principal):
            raise AuthError("token sub is not a valid id")
        teams = payload.get("teams", [])
        if not isinstance(teams, list) or not all(is_valid_id(team) for team in teams):
            raise AuthError("token teams is not an array of valid ids")
        anonymous = payload.get("is_anonymous") is True or payload.get("role") == "anon"
        expires_at = now + TOKEN_CACHE_MAX_AGE
        if exp is not None:
            expires_at = min(expires_at, exp + LEEWAY_SECONDS)
        return Identity(principal, teams, anonymous), expires_at


# ---- Supabase verifier --------------------------------------------------------

SUPABASE_CACHE_SECONDS = 60
_TOKEN_CHARACTERS = re.compile(r"[\x21-\x7e]+")   # printable ASCII, no spaces: safe in a header


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Refuse redirects, so the bearer token is never sent to another place."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class SupabaseVerifier:
    """Asks Supabase Auth who a token belongs to: GET {base_url}/auth/v1/user.

    200 with a user object -> Identity(id); anonymous users, 401 and 403 -> AuthError;
    a 200 whose id is a string but not a valid id -> AuthError; network errors,
    time-outs, redirects, other statuses and malformed 200 bodies -> AuthUnavailable.
    Positive verdicts are cached for 60 s by the token's SHA-256.
    """

    def __init__(self, base_url, anon_key, timeout=5.0, clock=time.monotonic):
        self.user_url = base_url.rstrip("/") + "/auth/v1/user"
        self.anon_key = anon_key
        self.timeout = timeout
        self.clock = clock
        self.cache = TokenCache()
        self._opener = urllib.request.build_opener(_NoRedirects)

    def verify(self, token):
        """The Identity of a token, from the cache or the service."""
        if not isinstance(token, str) or not token:
            raise AuthError("missing bearer token")
        if len(token) > MAX_TOKEN_LENGTH or _TOKEN_CHARACTERS.fullmatch(token) is None:
            raise AuthError("malformed bearer token")
        identity = self.cached(token)
        if identity is not None:
            return identity
        now = self.clock()
        identity = self._identity_from(self._ask(token))
        self.cache.put(token, identity, now + SUPABASE_CACHE_SECONDS)
        return identity

    def cached(self, token):
        """The Identity the service gave for a token lately (no request), or None."""
        return self.cache.get(token, self.clock())

    def _ask(self, token):
        """The body of a 200 response; AuthError on 401/403, AuthUnavailable otherwise."""
        request = urllib.request.Request(self.user_url, headers={
            "Authorization": "Bearer " + token,
            "apikey": self.anon_key,
            "Accept": "application/json",
        })
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                status = response.status
                body = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as error:
            error.close()
            if error.code in (401, 403):
                raise AuthError("token rejected by the identity service") from None
            raise AuthUnavailable("identity service answered %d" % error.code) from None
        except (OSError, http.client.HTTPException, ValueError):
            raise AuthUnavailable("identity service unreachable") from None
        if status != 200 or len(body) > MAX_RESPONSE_BYTES:
            raise AuthUnavailable("unexpected response from the identity service")
        return body

    def _identity_from(self, body):
        try:
            user = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            raise AuthUnavailable("malformed response from the identity service") from None
        if not isinstance(user, dict) or not isinstance(user.get("id"), str):
            raise AuthUnavailable("malformed response from the identity service")
        if not is_valid_id(user["id"]):
            raise AuthError("user id is not a valid id")
        if bool(user.get("is_anonymous")) or user.get("role") == "anon":
            raise AuthError("anonymous users are not accepted")
        return Identity(user["id"])


class RateLimiter:
    """A token bucket per principal: `per_minute` sustained, bursts of `burst`; 0 turns it off."""

    def __init__(self, per_minute, burst=None, clock=time.monotonic):
        self.rate = per_minute / 60.0
        self.burst = float(burst if burst is not None else max(1, per_minute // 2))
        self.clock = clock
        self._buckets = {}
        self._lock = threading.Lock()

    def retry_after(self, key):
        """0 when key may go ahead now (and takes a token), else the whole seconds to wait."""
        if self.rate <= 0:
            return 0
        now = self.clock()
        with self._lock:
            tokens, then = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            if tokens >= 1:
                self._buckets[key] = (tokens - 1, now)
                if len(self._buckets) > 10000:
                    self._forget_full(now)
                return 0
            self._buckets[key] = (tokens, now)
            return max(1, math.ceil((1 - tokens) / self.rate))

    def give_back(self, key):
        """Return the token key took last: what it was taken for is not to be counted after all."""
        if self.rate <= 0:
            return
        with self._lock:
            entry = self._buckets.get(key)
            if entry is not None:  # else forgotten meanwhile, as full
                tokens, then = entry
                self._buckets[key] = (min(self.burst, tokens + 1), then)

    def _forget_full(self, now):
        """Drop buckets that have refilled: they hold nothing a new bucket would not."""
        for key, (tokens, then) in list(self._buckets.items()):
            if tokens + (now - then) * self.rate >= self.burst:
                del self._buckets[key]


# ---- forged tokens ------------------------------------------------------------

def ip_address(text):
    """The IP address in text as an ipaddress object (an IPv4 client of a dual-stack socket as
    IPv4; an IPv6 zone left out), or None when text is no IP address."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def client_key(address):
    """What a client's failed token checks and its connections are counted under: its address, or
    for IPv6 its /64 (one host, or one home network, holds a whole /64 and could take a new address
    for each try).

        198.51.100.7                 198.51.100.7
        2001:db8:1:2:a:b:c:d         2001:db8:1:2::/64
        ::ffff:198.51.100.7          198.51.100.7     (an IPv4 client of a dual-stack socket)
        anything else                as it is
    """
    if ":" not in address:
        return address
    ip = ip_address(address)  # (without a zone: fe80::1%eth0)
    if ip is None:
        return address
    if ip.version == 4:
        return str(ip)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


class GuardedVerifier:
    """A JWT or Supabase verifier behind two guards, so that forged tokens stay cheap: a token it
    refused lately is refused again at once, and a client whose tokens failed too often lately has
    no new token checked (AuthThrottled) until its bucket in `failures` (a RateLimiter shared by
    the verifiers) refills.

    A JWT's signature is checked in pure Python under the GIL (ES256: 2.5 ms) and a Supabase token
    costs a request to the service: unbounded, a few connections sending forged tokens slow every
    response of the server. A token verified lately still passes when its client is throttled (a
    good client behind the same NAT as a broken one). Local tokens never come here: they cost a
    hash lookup, and one refused before it was issued must pass once it is.
    """

    def __init__(self, verifier, failures):
        self.verifier = verifier
        self.failures = failures
        self.refused = TokenCache(FAILED_TOKENS)   # token digest -> the text of its refusal

    def verify(self, token, client=None):
        """The verifier's Identity for token; client is the client's address (None: no bound per
        client), counted by client_key."""
        identity = self.verifier.cached(token)
        if identity is not None:
            return identity
        now = self.failures.clock()
        refusal = self.refused.get(token, now)
        if refusal is not None:
            raise AuthError(refusal)
        if client is not None:
            client = client_key(client)
            # Taken before the check, so that concurrent requests cannot overdraw the bucket; given
            # back unless the token fails.
            wait = self.failures.retry_after(client)
            if wait:
                raise AuthThrottled(wait)
        failed = False
        try:
            return self.verifier.verify(token)
        except AuthError as exc:
            failed = True
            if exc.lasting:
                self.refused.put(token, str(exc), now + FAILED_TOKEN_SECONDS)
            raise
        finally:
            # Verified, or cannot be checked now (AuthUnavailable).
            if client is not None and not failed:
                self.failures.give_back(client)


# ---- who may use the server ----------------------------------------------------

def read_principals(path):
    """{principal: quota in bytes, or None} of a principals file: one principal a line, optionally
    its storage quota (`bob 2GiB`); `#` starts a comment. ValueError naming the line for anything
    else (a bad id or size, more fields, a principal twice), and for an empty list."""
    with open(path, "rb") as f:
        data = f.read(MAX_PRINCIPALS_FILE_BYTES + 1)
    if len(data) > MAX_PRINCIPALS_FILE_BYTES:
        raise ValueError("larger than %s" % format_bytes(MAX_PRINCIPALS_FILE_BYTES))
    quotas = {}
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        fields = line.split("#", 1)[0].split(None, 1)
        if not fields:
            continue
        where = "line %d" % number
        principal, quota = fields[0], None
        if not is_valid_id(principal):
            raise ValueError("%s: %r is not a valid id ([A-Za-z0-9_-], 1 to 128 characters)"
                             % (where, principal))
        if principal in quotas:
            raise ValueError("%s: %s is listed twice" % (where, principal))
        if len(fields) > 1:
            try:
                quota = parse_size(fields[1])
            except ValueError as exc:
                raise ValueError("%s: %s" % (where, exc)) from None
        quotas[principal] = quota
    if not quotas:
        raise ValueError("it lists no principal (a server that lets no one in is a mistake)")
    return quotas


class PrincipalList:
    """The principals file (--principals-file): who may use the server, and the storage quota of
    each (None: no quota). reload() swaps the whole list at once, or keeps it (ValueError or
    OSError)."""

    def __init__(self, path):
        self.path = path
        self.quotas = read_principals(path)

    def reload(self):
        """Read the file again; the number of principals it lists."""
        self.quotas = read_principals(self.path)
        return len(self.quotas)


class Authenticator:
    """Chooses the verifier for a bearer token by its kind and the route family.

    Session sync: local tokens start with `ohs_`; JWTs (three dot-separated parts)
    go to the JWT verifier when one is configured (config: a ServerConfig, whose jwt, supabase,
    memory_mode and principals it takes). Memory sync (`memory_mode`):
    "local" accepts the same tokens, "supabase" asks
    a Supabase-compatible auth service, "off" refuses every memory request.
    JWTs and Supabase tokens are checked behind a GuardedVerifier; `failures` counts
    their failed checks per client (default: FAILED_CHECKS_PER_MINUTE, FAILED_CHECKS_BURST).
    Whatever the kind, an anonymous account is refused (AuthError), and with a PrincipalList
    (`principals`) a principal it does not list is too (NotListed).
    """

    def __init__(self, local, config, metrics, failures=None):
        self.local = local
        self.principals = config.principals
        self.jwt = config.jwt
        self.memory_mode = config.memory_mode
        self.supabase = config.supabase
        self.metrics = metrics
        self.failures = failures or RateLimiter(FAILED_CHECKS_PER_MINUTE, FAILED_CHECKS_BURST)
        self._guarded_jwt = (GuardedVerifier(self.jwt, self.failures)
                             if self.jwt is not None else None)
        self._guarded_supabase = (GuardedVerifier(self.supabase, self.failures)
                                  if self.supabase is not None else None)

    def identify(self, header, client=None):
        """The Identity for an Authorization header; AuthError for any unusable token,
        AuthThrottled when too many tokens from client (an opaque key, such as an address) failed
        lately."""
        return self._admitted(self._session_identity(bearer_token(header), client))

    def _admitted(self, identity):
        """identity, when it may use this server: not anonymous (AuthError), and listed when there
        is a principals file (NotListed)."""
        if identity.anonymous:
            raise AuthError("anonymous accounts are not accepted here")
        if self.principals is not None and identity.principal not in self.principals.quotas:
            raise NotListed("%s is not among the principals this server serves" %
                            identity.principal)
        return identity

    def _session_identity(self, token, client):
        if token.startswith(LOCAL_TOKEN_PREFIX):
            return self._counted("local", self.local.verify, token)
        if self._guarded_jwt is not None and token.count(".") == 2:
            return self._counted("jwt", self._guarded_jwt.verify, token, client)
        self.metrics.add("token_failures", "other")
        raise AuthError("unknown token")

    def _counted(self, kind, verify, *args):
        """verify(*args), with its failures and throttles counted by token kind."""
        try:
            return verify(*args)
        except AuthError:
            self.metrics.add("token_failures", kind)
            raise
        except AuthThrottled:
            self.metrics.add("token_throttled", kind)
            raise

    def identify_for_memory(self, header, client=None):
        """The Identity for memory sync; AuthError, AuthUnavailable, AuthThrottled or
        AuthNotConfigured."""
        token = bearer_token(header)
        if self.memory_mode == "off":
            raise AuthNotConfigured("memory sync is turned off on this server")
        if self.memory_mode == "supabase":
            # Never hand one of our tokens to another service.
            if token.startswith(LOCAL_TOKEN_PREFIX):
                self.metrics.add("token_failures", "local")
                raise AuthError("memory sync here needs an account token, not a local token")
            return self._admitted(self._counted("supabase", self._guarded_supabase.verify,
                                                token, client))
        return self._admitted(self._session_identity(token, client))


# -------------------------------------------------------------------------------------------------
# Storage: files, the data-dir lock, tokens
# -------------------------------------------------------------------------------------------------

class DataDir:
    """Where everything lives under a data dir: the one place that spells its paths.

    DIR/server.lock                            held by the running server, or a tool that needs
                                               the dir to itself (DataDirLock)
    DIR/tokens.json, DIR/tokens.lock           token hashes (TokenStore), and their writers' lock
    DIR/feeds/u-<principal>/p-<project>.jsonl  a personal feed
    DIR/feeds/t-<team>/p-<project>.jsonl       a team's feed
    DIR/feeds/purged.json                      where purged feeds ended, by a hash of their names
    DIR/feeds/restored.json                    where every feed numbers on from after a restore
    DIR/restored-from-backup.json              the restore mark: a copy not yet started on
    DIR/memory/u-<principal>/p-<project>/      a project's notes: manifest.json, objects/<rev>.json
    DIR/memory/u-<principal>/user/             the user scope's notes ("user" is no "p-" name)

    Ids are written with encode_name: reversibly, and safely on case-insensitive disks. An owner is
    ("u", principal) or ("t", team): two namespaces, so a principal and a team with one id never
    meet. An id whose name would pass NAME_MAX (255 bytes, with the longest suffix the layout adds
    to it) is named by its first 64 encoded characters, a dot and a hash of it (long_name:
    encode_name never writes a dot), and its full form kept beside it in NAME.id (e.g.
    feeds/u-<long>.id, feeds/u-x/p-<long>.id): a name with a dot is read from there, never
    guessed.
    """

    def __init__(self, path):
        # Resolved once: a link of the admin's making on the way to the data dir is no link in it
        # (open_in_data_dir walks the whole path).
        path = self.path = os.path.realpath(path)
        self.lock = os.path.join(path, "server.lock")
        self.tokens = os.path.join(path, "tokens.json")
        self.tokens_lock = os.path.join(path, "tokens.lock")
        self.feeds = os.path.join(path, "feeds")
        self.purged = os.path.join(path, "feeds", "purged.json")
        self.feed_floor = os.path.join(path, "feeds", "restored.json")
        self.restore_mark = os.path.join(path, "restored-from-backup.json")
        self.memory = os.path.join(path, "memory")

    def owner_dir(self, owner):
        kind, owner_id = owner
        return os.path.join(self.feeds, "%s-%s" % (kind, id_name(owner_id, DIR_PREFIX)))

    def feed_path(self, owner, project):
        return os.path.join(self.owner_dir(owner), "p-%s.jsonl" % id_name(project, FEED_SUFFIXES))

    def feed_names(self, owner, project):
        """[(path, id)] of the name files a feed of long ids needs (see long_name)."""
        kind, owner_id = owner
        return [(os.path.join(parent, prefix + name + ".id"), value)
                for parent, prefix, name, value in (
                    (self.feeds, kind + "-", id_name(owner_id, DIR_PREFIX), owner_id),
                    (self.owner_dir(owner), "p-", id_name(project, FEED_SUFFIXES), project))
                if "." in name]

    def scope_names(self, principal, scope):
        """[(path, id)] of the name files a memory scope of long ids needs."""
        named = [(self.memory, "u-", principal)]
        if scope.project is not None:
            named.append((self.memory_dir(principal), "p-", scope.project))
        return [(os.path.join(parent, prefix + id_name(value, DIR_PREFIX) + ".id"), value)
                for parent, prefix, value in named if "." in id_name(value, DIR_PREFIX)]

    def owner_feeds(self, owner):
        """[(project, os.DirEntry)] of owner's feed files, in no order."""
        if os.path.islink(self.feeds) or os.path.islink(self.owner_dir(owner)):
            return []  # (fsck names it)
        try:
            entries = list(os.scandir(self.owner_dir(owner)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for entry in entries:
            if _is_feed_name(entry.name) and not entry.is_symlink():
                project = id_of_name(self.owner_dir(owner), "p-", entry.name[2:-6])
                if project is not None:
                    found.append((project, entry))
        return found

    def all_feeds(self):
        """(owner, project, os.DirEntry) of every file under DIR/feeds/u-*|t-*, sorted by path;
        owner and project are None for a file that is no feed. Links are left out (links())."""
        for owner_entry in _sorted_dirs(self.feeds, ("u-", "t-")):
            owner_id = id_of_name(self.feeds, owner_entry.name[:2], owner_entry.name[2:])
            for entry in sorted(os.scandir(owner_entry.path), key=lambda entry: entry.name):
                if entry.is_symlink() or _is_name_file(entry.name):
                    continue
                project = (id_of_name(owner_entry.path, "p-", entry.name[2:-6])
                           if _is_feed_name(entry.name) and owner_id is not None else None)
                if project is not None:
                    yield (owner_entry.name[0], owner_id), project, entry
                else:
                    yield None, None, entry

    def memory_dir(self, principal):
        return os.path.join(self.memory, "u-" + id_name(principal, DIR_PREFIX))

    def scope_files(self, principal, scope):
        return ScopeFiles(os.path.join(self.memory_dir(principal),
                                       "user" if scope.project is None
                                       else "p-" + id_name(scope.project, DIR_PREFIX)))

    def memory_dirs(self):
        """(principal, path) of every principal's directory under DIR/memory."""
        for entry in _sorted_dirs(self.memory, ("u-",)):
            principal = id_of_name(self.memory, "u-", entry.name[2:])
            if principal is not None:
                yield principal, entry.path

    def all_scopes(self):
        """(principal, MemoryScope, ScopeFiles) of every scope directory, sorted by path (those
        whose names are no valid ids are not scopes of this server's making, and are left out)."""
        for principal, principal_path in self.memory_dirs():
            for scope_entry in _sorted_dirs(principal_path, ("p-", "user")):
                name = scope_entry.name
                project = None if name == "user" else id_of_name(principal_path, "p-", name[2:])
                if (is_valid_id(principal) and (name == "user" or is_valid_id(project))):
                    scope = USER_SCOPE if project is None else MemoryScope(project)
                    yield principal, scope, self.scope_files(principal, scope)

    def purge_aside(self, directory, principal):
        """Where purge moves a principal's feeds or memory directory (directory: DIR/feeds or
        DIR/memory) before it removes what is in it: a name no walk takes for an owner's, which a
        second purge of the principal finds to finish what a crash interrupted."""
        return os.path.join(directory, PURGING_PREFIX + hashlib.sha256(
            principal.encode("utf-8")).hexdigest()[:32])

    def purge_leftovers(self):
        """The directories interrupted purges left in DIR/feeds and DIR/memory, sorted."""
        return sorted(entry.path for directory in (self.feeds, self.memory)
                      for entry in _sorted_dirs(directory, (PURGING_PREFIX,)))

    def unnamed(self):
        """(path, its name file) of each file or directory named for a long id whose name file is
        missing or does not match (its contents are then never listed), sorted."""
        found = []
        for directory, prefixes in ((self.feeds, ("u-", "t-")), (self.memory, ("u-",))):
            for entry in _sorted_dirs(directory, prefixes):
                names = [(directory, entry.name[:2], entry.name[2:], entry.path)]
                if id_of_name(directory, entry.name[:2], entry.name[2:]) is not None:
                    children = ([(e.name[2:-6], e.path) for e in os.scandir(entry.path)
                                 if _is_feed_name(e.name)] if directory == self.feeds
                                else [(e.name[2:], e.path) for e in _sorted_dirs(entry.path,
                                                                                  ("p-",))])
                    names = [(entry.path, "p-", name, path) for name, path in children]
                for parent, prefix, name, path in names:
                    if "." in name and id_of_name(parent, prefix, name) is None:
                        found.append((path, os.path.join(parent, prefix + name + ".id")))
        return sorted(found)

    def name_files(self):
        """The path of every long id's name file (see long_name), sorted."""
        found = []
        for directory in [self.feeds, self.memory] + [
                entry.path for entry in _sorted_dirs(self.feeds, ("u-", "t-"))
                + _sorted_dirs(self.memory, ("u-",))]:
            try:
                found.extend(entry.path for entry in os.scandir(directory)
                             if _is_name_file(entry.name) and not entry.is_symlink())
            except (FileNotFoundError, NotADirectoryError):
                pass
        return sorted(found)

    def walk(self, deep=True):
        """(path, lstat result, written) of the data dir and of each file and directory of its
        layout that is there, a directory before what it holds (listed only once the caller has
        had it): written, whether a file is changed in place (a feed, a lock), not replaced by a
        file made aside. deep: feeds/ and memory/ and all under them too. A link is never
        followed."""
        yield self.path, os.stat(self.path), False
        for path, written in ((self.lock, True), (self.tokens, False), (self.tokens_lock, True),
                              (self.feeds, None), (self.memory, None)):
            if written is None and not deep:
                continue
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            yield path, info, bool(written)
            if stat.S_ISDIR(info.st_mode):
                yield from self._walk_under(path)

    def _walk_under(self, directory):
        for entry in sorted(os.scandir(directory), key=lambda entry: entry.name):
            info = entry.stat(follow_symlinks=False)
            yield entry.path, info, _is_feed_name(entry.name)
            if stat.S_ISDIR(info.st_mode):
                yield from self._walk_under(entry.path)

    def links(self):
        """The path of every link in the data dir, sorted (the layout has none: each is refused,
        never followed), found without following any."""
        found, todo = [], [self.path]
        while todo:
            try:
                entries = list(os.scandir(todo.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                if entry.is_symlink():
                    found.append(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
        return sorted(found)


# Opening a file of the data dir never follows a link: not the file's own name (O_NOFOLLOW), nor
# any directory on the way to it. Each directory of the path is opened without following, and the
# next name looked up in it (dir_fd), so a directory swapped for a link meanwhile is refused too.
# DataDir's paths are absolute and hold no link of the admin's making (it resolves its root once),
# so the whole path is walked from "/".
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_WALK_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
_CAN_WALK = os.open in os.supports_dir_fd and _NOFOLLOW != 0


def open_in_data_dir(path, flags, mode=0o600):
    """os.open of a data-dir file or directory that follows no link: LinkRefused names one found
    on the way or at path."""
    path = os.path.abspath(path)
    if not _CAN_WALK:  # (Windows: no links to speak of, and no dir_fd)
        return os.open(path, flags | _NOFOLLOW, mode)
    names = [name for name in path.split(os.sep) if name]
    fd = os.open(os.sep, _WALK_FLAGS)
    try:
        for depth, name in enumerate(names):
            last = depth == len(names) - 1
            try:
                found = os.open(name, flags | _NOFOLLOW if last else _WALK_FLAGS,
                                mode, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR) and _is_link(name, fd):
                    raise LinkRefused(os.sep + os.path.join(*names[:depth + 1])) from None
                raise
            os.close(fd)
            fd = found
        return fd
    except BaseException:
        os.close(fd)
        raise


def list_data_dir(path):
    """The names in a data-dir directory, listed without following a link to it or on the way
    (LinkRefused)."""
    if not _CAN_WALK:
        return os.listdir(path)
    fd = open_in_data_dir(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _is_link(name, dir_fd):
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def open_data_file(path, flags=os.O_RDONLY, mode=0o600):
    """A data-dir file as a buffered binary file object, opened without following any link (see
    open_in_data_dir); flags tell how ("rb" without them, "r+b" with O_RDWR, "ab" with
    O_APPEND)."""
    fd = open_in_data_dir(path, flags, mode)
    how = "rb" if flags & 3 == os.O_RDONLY else "ab" if flags & os.O_APPEND else "r+b"
    try:
        return os.fdopen(fd, how)
    except BaseException:
        os.close(fd)
        raise


def _is_feed_name(name):
    return name.startswith("p-") and name.endswith(".jsonl")


def _is_name_file(name):
    return name.endswith(".id") and name[:2] in ("u-", "t-", "p-")


NAME_MAX = 255
PURGING_PREFIX = "purging-"
DIR_PREFIX = len("u-")                  # what the layout adds to an id in a directory's name
FEED_SUFFIXES = len("p-.jsonl")  # what it adds to a project's in a feed file's (aside_path's
                                 # hashed name keeps a compaction's file under NAME_MAX too)


def id_name(value, room):
    """The name an id has in the data dir, where room characters go around it: encode_name's
    (as ever), or long_name's when that would make a name longer than NAME_MAX."""
    name = encode_name(value)
    return name if len(name) + room <= NAME_MAX else long_name(value)


def long_name(value):
    """A long id's name: its first 64 encoded characters, a dot, and 32 hex of its SHA-256 (the dot
    says the full id is in a name file; encode_name never writes one)."""
    return "%s.%s" % (encode_name(value)[:64],
                      hashlib.sha256(value.encode("utf-8")).hexdigest()[:32])


def id_of_name(directory, prefix, name):
    """The id whose name (less prefix) is name in directory: decode_name's, or a long one's read
    from its name file (prefix + name + ".id"); None when that is missing or does not match."""
    if "." not in name:
        return decode_name(name)
    try:
        with open_data_file(os.path.join(directory, prefix + name + ".id")) as f:
            value = f.read(256).decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return value if is_valid_id(value) and long_name(value) == name else None


def write_name_files(names, owner=None):
    """Write the name files [(path, id)] that are not there yet (DataDir.feed_names, scope_names),
    durably, before the file or directory they name is made."""
    for path, value in names:
        if not os.path.lexists(path):
            make_dirs(os.path.dirname(path))
            write_atomically(path, value.encode("ascii"), owner)


def _sorted_dirs(path, prefixes):
    """The directories in path whose names begin with one of prefixes, sorted by name (a link to
    one is none)."""
    if os.path.islink(path):
        return []
    try:
        entries = sorted(os.scandir(path), key=lambda entry: entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [entry for entry in entries
            if entry.is_dir(follow_symlinks=False) and entry.name.startswith(prefixes)]


def _file_size(path):
    """The size of the file at path (a link's own, never its target's); 0 when there is none."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0

def sync_file(fd):
    """Make the bytes written to fd durable (fdatasync where there is one)."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:
        os.fsync(fd)


def sync_dir(path):
    """Make a directory's entries (a new or renamed file) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def make_dirs(path):
    """Create path and its missing parents, syncing each parent so the new entries survive a crash.
    Returns the directories it created, outermost first. LinkRefused when it would create one
    through a link (the directory they go in is one) or one is a link already: a path with links
    of the admin's making is given resolved (os.path.realpath)."""
    missing = []
    # A relative path's dirname ends at "", which is never a directory.
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    if missing and os.path.islink(path):
        raise LinkRefused(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            if os.path.islink(directory):
                raise LinkRefused(directory) from None
        sync_dir(os.path.dirname(directory))
    return missing[::-1]


def write_all(fd, data):
    """os.write until every byte is written."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_atomically(path, data, mode=None):
    """Replace path with data: temporary file, fsync, rename, fsync of the directory.
    mode: the new file's mode (else 0600)."""
    directory = os.path.dirname(path)
    temporary = "%s.tmp-%s" % (path, secrets.token_hex(4))
    fd = open_in_data_dir(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            if mode is not None:
                keep_mode(fd, mode)
            write_all(fd, data)
            sync_file(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    sync_dir(directory)


def keep_mode(fd, mode):
    """Give an open file the mode of the file it replaces (not this process's umask's)."""
    if (os.fstat(fd).st_mode & 0o7777) != mode:
        os.fchmod(fd, mode)


def user_name(uid):
    """The login name of uid, else "uid N"."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (AttributeError, KeyError):  # no pwd module (Windows), or no such user
        return "uid %d" % uid


def act_as_data_dir_owner(path, log):
    """When root runs this on a data dir (path) that another user owns, become that user for good:
    their groups, then their group, then their uid, in that order; log says so in one line. Every
    file a command makes is then the owner's, and no link planted in the dir can make root write
    where its owner may not. A no-op for any other user, for a dir root owns or that is not there
    yet (root makes it, and it stays root's), and where there are no users (Windows). Called once
    what only root may read is read, and (the server) its port bound."""
    if not hasattr(os, "setuid") or os.geteuid() != 0:
        return
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError("cannot use data dir %s: %s" % (path, reason(exc))) from None
    if info.st_uid == 0:
        return
    try:
        account = pwd.getpwuid(info.st_uid)
        name, gid = account.pw_name, account.pw_gid
    except KeyError:  # a uid with no name: the dir's group, alone
        name, gid = None, info.st_gid
    try:
        if name is None:
            os.setgroups([gid])
        else:
            os.initgroups(name, gid)
        os.setgid(gid)
        os.setuid(info.st_uid)
    except OSError as exc:
        raise UsageError("cannot run as uid %d, the owner of %s: %s"
                         % (info.st_uid, path, reason(exc))) from None
    name = name or "uid %d" % info.st_uid
    log("running as %s (uid %d), the owner of %s" % (name, info.st_uid, path))
    above = os.sep
    for part in path.split(os.sep)[1:]:  # (a dir under /root, say, is closed to its owner)
        try:
            os.stat(os.path.join(above, part))
        except PermissionError:
            raise UsageError("%s, the owner of %s, cannot reach it: %s does not let them in "
                             "(chmod o+x %s, or move the data dir)"
                             % (name, path, above, above)) from None
        above = os.path.join(above, part)


def ownership_fix(data_dir):
    """What to do when this process cannot use a file of data_dir: run as the dir's owner, or
    (run as them already) give them back what is not theirs."""
    try:
        owner = os.stat(data_dir).st_uid
    except OSError:
        owner = os.geteuid()
    name = user_name(owner)
    if owner != os.geteuid():
        return ("run this as %s, the data dir's owner: sudo -u %s python3 oharness_sync.py ..."
                % (name, name))
    return "give its owner back what is in it: sudo chown -R %s: %s" % (name, data_dir)


def reason_and_fix(exc, data_dir):
    """The reason of an OSError met in data_dir, and the fix when it is a permission's."""
    if isinstance(exc, PermissionError):
        return "%s; %s" % (reason(exc), ownership_fix(data_dir))
    return reason(exc)


def check_data_dir_access(layout, write=True, deep=True):
    """UsageError naming the first file or directory of the data dir at layout this process cannot
    read (or, with write, change: a directory's entries, a file changed in place) by its mode, and
    the fix; before anything is made. One lstat a file (DataDir.walk); nothing to check for
    root."""
    if not hasattr(os, "geteuid") or os.geteuid() == 0:
        return
    uid, groups = os.geteuid(), set(os.getgroups()) | {os.getegid()}
    try:
        for path, info, written in layout.walk(deep):
            if stat.S_ISLNK(info.st_mode):
                continue
            changed = write and (written or stat.S_ISDIR(info.st_mode))
            need = (0o5 if stat.S_ISDIR(info.st_mode) else 0o4) | (0o2 if changed else 0)
            shift = 6 if info.st_uid == uid else 3 if info.st_gid in groups else 0
            lacks = need & ~(info.st_mode >> shift)
            if lacks:
                raise UsageError("cannot %s %s: it is %s's, mode %04o; %s" % (
                    " or ".join(verb for bits, verb in ((0o5, "read"), (0o2, "write"))
                                if lacks & bits),
                    path, user_name(info.st_uid), info.st_mode & 0o7777,
                    ownership_fix(layout.path)))
    except OSError as exc:  # (an ACL said no where the mode did not)
        raise UsageError("cannot read %s: %s" % (exc.filename or layout.path,
                                                 reason_and_fix(exc, layout.path))) from None


def lock_exclusively(fd):
    """Take an exclusive lock on an open file without waiting; False when another process holds
    it."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:  # pragma: no cover - Windows
            import msvcrt
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


class DataDirLock:
    """DIR/server.lock, held exclusively: one process at a time works on a data dir. Two modes.
    The server's (tool None): acquire() makes the file and writes the process id in it, and holds
    it while serving. A tool's that needs the dir to itself (tool: its name, as its refusal says
    it): acquire() locks the file as it is, writing nothing, and makes none where there is none (no
    server has run on the dir) until change(), called before the tool's first change, so that a
    dry run or a refusal leaves the dir as it was. UsageError (exit 2) while another holds it."""

    def __init__(self, data_dir, tool=None):
        self.data_dir, self.tool = data_dir, tool
        self.path = DataDir(data_dir).lock
        self.fd = None

    def acquire(self):
        if self.tool is None:
            self._take(os.O_RDWR | os.O_CREAT)
            os.ftruncate(self.fd, 0)
            os.write(self.fd, b"%d\n" % os.getpid())
        else:
            self._take(os.O_RDWR)

    def change(self):
        """A tool's lock before its first change: the lock file is made when there is none."""
        if self.fd is None:
            self._take(os.O_RDWR | os.O_CREAT | os.O_EXCL)

    def _take(self, flags):
        try:
            fd = open_in_data_dir(self.path, flags)
        except FileNotFoundError as exc:
            if self.tool is None:
                raise self._unusable(exc) from None
            if not flags & os.O_CREAT:
                return  # (no lock file: no server has run here)
            raise UsageError("cannot lock %s: no such directory" % self.data_dir) from None
        except FileExistsError:  # made since it was looked for: a server is starting
            raise self._busy() from None
        except OSError as exc:
            raise self._unusable(exc) from None
        if not lock_exclusively(fd):
            os.close(fd)
            raise self._busy()
        self.fd = fd

    def _unusable(self, exc):
        if self.tool is None:
            return UsageError("cannot open %s: %s" % (
                self.path, reason_and_fix(exc, os.path.dirname(self.path))))
        return UsageError("cannot lock %s: %s" % (self.data_dir, reason(exc)))

    def _busy(self):
        if self.tool is None:
            return UsageError("another oharness-sync server is already using %s"
                              % os.path.dirname(self.path))
        return UsageError("a server is using %s: stop it first (%s needs the data dir to itself)"
                          % (self.data_dir, self.tool))

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class TokenStore:
    """Local opaque tokens, kept in DIR/tokens.json only as SHA-256 hashes.

    Each record: id (12 hex, not secret), hash, principal, teams, name, created
    and expires (Unix ms or null). The file is replaced atomically; the command
    line serialises its read-modify-write with DIR/tokens.lock. A new file keeps
    the old one's mode; it is made by the data dir's owner (root works as them:
    act_as_data_dir_owner), so their server can read it.
    """

    def __init__(self, data_dir, clock=time.time):
        layout = DataDir(data_dir)
        self.path = layout.tokens
        self.lock_path = layout.tokens_lock
        self.clock = clock

    def version(self):
        """Something that changes whenever the file is replaced: (inode, mtime, size), or None."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self):
        """All token records; [] when there is no file. ValueError when the file is damaged."""
        try:
            with open_data_file(self.path) as f:
                doc = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            return []
        except RecursionError:
            raise ValueError("not a token file: JSON nested too deeply") from None
        records = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(records, list) or not all(map(self._well_formed, records)):
            raise ValueError("not a token file")
        return records

    @staticmethod
    def _well_formed(record):
        return (isinstance(record, dict)
                and isinstance(record.get("id"), str)
                and re.fullmatch(r"[0-9a-f]{12}", record["id"]) is not None
                and isinstance(record.get("hash"), str)
                and re.fullmatch(r"[0-9a-f]{64}", record["hash"]) is not None
                and is_valid_id(record.get("principal"))
                and isinstance(record.get("teams"), list)
                and all(map(is_valid_id, record["teams"]))
                and isinstance(record.get("name", ""), str)
                and all(record.get(stamp) is None or as_safe_int(record[stamp]) is not None
                        for stamp in ("created", "expires")))

    def mode(self):
        """The mode the token file keeps: the present file's, else 0600. UsageError, naming the
        user to run as, when this process is not the file's owner (or the data dir's, before
        there is one): the file it made would be its own, not theirs."""
        try:
            info, whose = os.lstat(self.path), self.path
            if stat.S_ISLNK(info.st_mode):
                raise LinkRefused(self.path)
            mode = info.st_mode & 0o7777
        except FileNotFoundError:
            whose = os.path.dirname(self.path)
            info, mode = os.stat(whose), 0o600
        if hasattr(os, "geteuid") and os.geteuid() not in (0, info.st_uid):
            raise UsageError("%s belongs to %s: %s" % (whose, user_name(info.st_uid),
                                                      ownership_fix(os.path.dirname(self.path))))
        return mode

    def _update(self, change):
        """Apply change(records) under the command-line lock and write the file atomically, keeping
        its mode."""
        self.mode()  # refused before anything is written
        try:
            fd = open_in_data_dir(self.lock_path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise UsageError("cannot open %s: %s" % (
                self.lock_path, reason_and_fix(exc, os.path.dirname(self.path)))) from None
        try:
            while not lock_exclusively(fd):
                time.sleep(0.05)
            records = self.read()
            result = change(records)
            write_atomically(self.path, encode_json({"version": 1, "tokens": records}) + b"\n",
                             self.mode())
            return result
        finally:
            os.close(fd)

    def issue(self, principal, teams=(), name="", expires_days=None):
        """Create a token; return (token, record). The token itself is never stored."""
        token_id = secrets.token_hex(6)
        token = "%s%s_%s" % (LOCAL_TOKEN_PREFIX, token_id, secrets.token_urlsafe(32))
        now_ms = int(self.clock() * 1000)
        record = {
            "id": token_id, "hash": token_hash(token), "principal": principal,
            "teams": sorted(set(teams)), "name": name, "created": now_ms,
            "expires": None if expires_days is None else now_ms + int(expires_days * 86400000),
        }
        self._update(lambda records: records.append(record))
        return token, record

    def revoke(self, token_id, hashed=None):
        """Remove a token by id (and hash, when given: a whole token was named); False when there
        is none."""
        def change(records):
            kept = [record for record in records
                    if (record["id"] != token_id
                        or (hashed is not None and record["hash"] != hashed))]
            removed = len(kept) != len(records)
            records[:] = kept
            return removed
        return self._update(change)


# -------------------------------------------------------------------------------------------------
# Storage: session feeds
# -------------------------------------------------------------------------------------------------
#
# One append-only file per (owner, project). Each line holds one event number:
#
#   {"n":7,"k":"r","h":"<32 hex dedupe key>","e":<record>,"c":"<crc32>"}
#   {"n":8,"k":"s","t":<ms>,"e":<session metadata>,"c":"<crc32>"}
#   {"n":9,"k":"x","h":"<32 hex dedupe key>","c":"<crc32>"}    an erased record
#   {"n":10,"k":"x","c":"<crc32>"}                              a number whose line was lost
#
# n is the event number (the cursor), k the kind, e the event exactly as it is sent to a pull, t
# the server's clock when session metadata was stored (older lines have none), c the CRC-32 of
# every byte before `,"c":`. Numbers only grow, and may skip: a compaction drops superseded
# metadata and leaves of an erased record only its number and key (k "x"), so that no number is
# ever handed to another event and a device that still holds the record cannot push it again; a
# torn or damaged last line leaves its number behind the same way. A pull copies the bytes of e
# without parsing them; a start-up reads n, k and h, and parses only the (few) session events.

_LINE_HEAD = re.compile(rb'\{"n":([0-9]{1,16}),"k":"([rsx])"(?:,"h":"([0-9a-f]{32})")?'
                        rb'(?:,"t":([0-9]{1,16}))?')
_EVENT_START = b',"e":'
_LINE_TAIL = b',"c":"'
_CHECKSUM = re.compile(rb"[0-9a-f]{8}")
_TAIL_LENGTH = 17  # ,"c":"XXXXXXXX"}\n


def feed_line(number, kind, event=None, key=None, stored=None):
    """One feed line: kind b"r" (a record, with its key), b"s" (session metadata, with the time it
    was stored) or b"x" (no event: an erased record's key, or none)."""
    content = b'{"n":%d,"k":"%s"' % (number, kind)
    if key is not None:
        content += b',"h":"%032x"' % key
    if stored is not None:
        content += b',"t":%d' % stored
    if event is not None:
        content += _EVENT_START + event
    return b'%s,"c":"%08x"}\n' % (content, zlib.crc32(content))


def parse_feed_line(line):
    """(number, kind, key or None, stored time or None, event bytes or None) of a feed line;
    ValueError when it is damaged."""
    if not line.endswith(b'"}\n') or line[-_TAIL_LENGTH:-11] != _LINE_TAIL:
        raise ValueError("incomplete or malformed line")
    content = line[:-_TAIL_LENGTH]
    checksum = line[-11:-3]
    if _CHECKSUM.fullmatch(checksum) is None or int(checksum, 16) != zlib.crc32(content):
        raise ValueError("checksum mismatch")
    head = _LINE_HEAD.match(content)
    if head is None:
        raise ValueError("malformed line")
    number, kind, key, stored = head.groups()
    rest = content[head.end():]
    if kind == b"x":
        good, event = not rest and stored is None, None
    else:
        good = (rest.startswith(_EVENT_START) and (kind == b"r") == (key is not None)
                and (kind == b"s" or stored is None))
        event = rest[len(_EVENT_START):]
    if not good:
        raise ValueError("malformed line")
    return (int(number), kind, None if key is None else int(key, 16),
            None if stored is None else int(stored), event)


def scan_feed(f):
    """Read an open feed file line by line, checking each line as the server takes it. Yields
    (line number, offset, line, number, kind, key, session, problem, last) per line:

        a record         number, b"r", its dedupe key, None
        session metadata number, b"s", None, (id, (gen, updatedAt), deleted, stored time or None)
        a kept number    number, b"x", an erased record's key or None, None
        a bad line       None, None, None, None, and problem says what is wrong; last, whether it
                         is the file's last line (which a crash may have torn)

    A number must be above the one before it."""
    before, offset = 0, 0
    for line_number, line in enumerate(f, 1):
        try:
            number, kind, key, stored, event = parse_feed_line(line)
            if number <= before:
                raise ValueError("event number %d after %d" % (number, before))
            session = None
            if kind == b"s":
                doc = json.loads(event)
                session = (doc["id"], (doc["gen"], doc["updatedAt"]), doc.get("deleted") is True,
                           stored)
        except (ValueError, KeyError, TypeError) as exc:
            yield line_number, offset, line, None, None, None, None, str(exc), not f.peek(1)
        else:
            before = number
            yield line_number, offset, line, number, kind, key, session, None, False
        offset += len(line)


def cut_tail(path, offset, number):
    """Cut a feed file back to offset, durably, keeping number: a torn or damaged last line goes,
    and a line that holds no event takes its place, so its number is never handed to another."""
    with open_data_file(path, os.O_RDWR) as f:
        f.truncate(offset)
        f.seek(offset)
        f.write(feed_line(number, b"x"))
        f.flush()
        sync_file(f.fileno())


def lost_number(line, before):
    """The number a damaged line held, as far as can be told: its own when its head still reads,
    else the one after the line before it."""
    head = _LINE_HEAD.match(line)
    return max(int(head.group(1)), before + 1) if head is not None else before + 1


def split_events(data):
    """The (records, sessions) event bytes of a run of whole feed lines, without parsing JSON;
    lines without an event are left out."""
    records, sessions = [], []
    for line in data.split(b"\n")[:-1]:
        kind = line[line.find(b',"k":"') + 6]
        if kind == 0x78:  # b"x"
            continue
        event = line[line.find(_EVENT_START) + 5:1 - _TAIL_LENGTH]
        if kind == 0x72:  # b"r"
            records.append(event)
        else:
            sessions.append(event)
    return records, sessions


def record_session(event):
    """The session id of a record event, as stored (its first field)."""
    return json.loads(event)["session"]


class FeedIndex:
    """Where each line of a feed file starts, and which number and whether an event it holds.

    While a feed is dense (line i holds event i + 1, as every feed did before compaction), only
    the offsets are kept. Once numbers skip or a line holds no event, the numbers of the lines and
    a running count of their events are kept too, and a pull finds its place by bisection.
    """

    __slots__ = ("offsets", "numbers", "events_before", "end", "last_event", "events")

    def __init__(self, end=0):
        self.offsets = array.array("Q", [0])   # offsets[i]: where line i starts; [-1]: the end
        self.numbers = None                    # numbers[i]: line i's number, once not dense
        self.events_before = None              # events in lines [0, i), once not dense
        self.end = end                         # the highest number given to a line
        self.last_event = 0                    # the number of the last event
        self.events = 0

    @property
    def lines(self):
        return len(self.offsets) - 1

    def add(self, number, size, event=True):
        """Index the next line: its number (above every one before), size and whether it holds an
        event."""
        if self.numbers is None and (number != self.lines + 1 or not event):
            self.numbers = array.array("Q", range(1, self.lines + 1))
            self.events_before = array.array("Q", range(self.lines + 1))
        self.offsets.append(self.offsets[-1] + size)
        if event:
            self.events += 1
            self.last_event = number
        if self.numbers is not None:
            self.numbers.append(number)
            self.events_before.append(self.events)
        self.end = number

    def line(self, i):
        """(number, size, event) of line i."""
        size = self.offsets[i + 1] - self.offsets[i]
        if self.numbers is None:
            return i + 1, size, True
        return self.numbers[i], size, self.events_before[i + 1] > self.events_before[i]

    def page(self, since, limit, max_bytes=None):
        """(first line, line after the last, cursor, more) of the page of at most limit events
        after since whose lines stay within max_bytes (default MAX_PAGE_BYTES; one event at least):
        the cursor is the last event's number (since when there is none), and more says whether
        events follow it."""
        offsets = self.offsets
        max_bytes = MAX_PAGE_BYTES if max_bytes is None else max_bytes
        if self.numbers is None:
            start = min(since, self.lines)
            fits = bisect.bisect_right(offsets, offsets[start] + max_bytes, start) - 1
            stop = min(self.lines, start + limit, max(start + 1, fits))
            return start, stop, stop if stop > start else since, stop < self.lines
        start = bisect.bisect_right(self.numbers, since)
        before = self.events_before
        wanted = min(limit, self.events - before[start])
        if wanted <= 0:
            return start, start, since, False
        stop = bisect.bisect_left(before, before[start] + wanted, start)
        if offsets[stop] - offsets[start] > max_bytes:
            fits = bisect.bisect_right(offsets, offsets[start] + max_bytes, start) - 1
            # Back to the last event within the bytes, or on to the first one after start.
            events = max(before[fits], before[start] + 1)
            stop = bisect.bisect_left(before, events, start)
        return start, stop, self.numbers[stop - 1], before[stop] < self.events


class Page:
    """What a pull returns: events after a cursor, split into records and sessions."""
    __slots__ = ("cursor", "records", "sessions", "more", "_json")

    def __init__(self, cursor, records=(), sessions=(), more=False):
        self.cursor = cursor
        self.records = records
        self.sessions = sessions
        self.more = more
        self._json = None

    def to_json(self):
        if self._json is None:  # built once, however many parked pulls answer with this page
            self._json = b'{"cursor":%d,"records":[%s],"sessions":[%s],"more":%s}' % (
                self.cursor, b",".join(self.records), b",".join(self.sessions),
                b"true" if self.more else b"false")
        return self._json


class _Batch:
    """One push's new lines, waiting for the group commit that makes them durable, and its outcome:
    (cursor, accepted) once durable, or the StorageError that stopped it. Its push waits on its own
    Condition (of the feed's lock), so a flush wakes each push once: when its batch is settled, or
    when it is to flush the next group. A batch also keeps what its push found already there
    (skipped), which may be in flight in another push's batch: should that one fail, so must this
    push."""
    __slots__ = ("lines", "keys", "undo_meta", "winners", "skipped_keys", "skipped_meta",
                 "outcome", "woken")

    def __init__(self):
        self.lines = []
        self.keys = []
        self.undo_meta = []
        self.winners = []                      # (session id, where its new winning line will be)
        self.skipped_keys = []                 # dedupe keys of records found already there
        # (session id, stamp) of metadata that lost to what was there
        self.skipped_meta = []
        self.outcome = None
        self.woken = None                      # its Condition, made when its push has to wait

    def still_there(self, keys, meta):
        """Whether every record and metadata entry its push found already there still is, in a
        feed's keys and meta (its lock held)."""
        return (all(key in keys for key in self.skipped_keys)
                and not any(metadata_wins(stamp, meta.get(session_id))
                            for session_id, stamp in self.skipped_meta))

    def undo(self, keys, meta):
        """Take its records' keys and its metadata wins out of a feed's keys and meta again (its
        write failed; newer batches first)."""
        for session_id, old in reversed(self.undo_meta):
            if old is None:
                del meta[session_id]
            else:
                meta[session_id] = old
        keys.difference_update(self.keys)


class FeedWaiter:
    """A wait for a feed's next durable event (a parked pull's): the Condition it waits on, and
    what the thread that wakes it calls first (on_event, or None). One may serve several waits in
    turn; its Condition's lock is reentrant, so that its caller may hold it across a wait
    (SyncApp.park: what it looks at before the wait cannot change unseen before the wait
    begins)."""
    __slots__ = ("woken", "on_event")

    def __init__(self, on_event=None):
        self.woken = threading.Condition(threading.RLock())
        self.on_event = on_event


def wake_waiters(waiters, log):
    """Wake FeedWaiters: first each one's on_event, in this thread, then a notify each.

    This is where a push hands other connections their responses. The thousand threads of a
    thousand woken pulls would take turns on the interpreter lock before each could send its own
    response; so the waking thread (the push's, once its events are durable) calls each pull's
    on_event, which sends that pull its response without waiting (SyncApp.park,
    SyncRequestHandler.respond_early), and the pulls' own threads, notified after, only finish what
    a full socket did not take."""
    for waiter in waiters:
        if waiter.on_event is not None:
            try:
                waiter.on_event()
            except Exception as exc:  # the others must still be woken; this one answers for itself
                log("waking a parked pull: %s: %s" % (type(exc).__name__, exc))
    for waiter in waiters:
        with waiter.woken:
            waiter.woken.notify()


# -- compaction: what a feed can do without ------------------------------------------------------
#
# A compaction keeps every event number: it drops a session's metadata lines that a later winner
# replaced, and of the records of a session deleted longer ago than the retention window (by the
# server's clock when the deletion was stored) it keeps only their numbers and keys. A pull skips
# the gaps; a client that pulls on from any cursor ends where it would have, less erased records.

COMPACT_SUFFIX = ".compact"  # the new file, written aside until it replaces the feed's


def aside_path(path):
    """Where a rewrite of the feed file path is written until it replaces it: path + ".compact",
    or, where that name would pass NAME_MAX (a project's name of 240 to 247 encoded characters,
    stored under its own name before long names were hashed), "p-." and a hash of the feed's
    name, with the same ending (no feed's name starts "p-.": encode_name writes no dot)."""
    directory, name = os.path.split(path)
    if len(name) + len(COMPACT_SUFFIX) <= NAME_MAX:
        return path + COMPACT_SUFFIX
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]
    return os.path.join(directory, "p-.%s.jsonl%s" % (digest, COMPACT_SUFFIX))


class FeedSummary:
    """One reading of a feed file (summarize_feed): the size of its good lines, their count, its
    events, records and erased records, the highest number it holds (a torn last line's too), the
    winning metadata line of each session (id -> (number, size, deleted, stored)), and the bytes of
    metadata lines a later winner replaced."""

    __slots__ = ("size", "lines", "events", "records", "erased", "end", "winners",
                 "superseded_bytes")

    def __init__(self):
        self.size = self.lines = self.events = self.records = self.erased = self.end = 0
        self.winners = {}
        self.superseded_bytes = 0


def summarize_feed(path, end=None, pause=lambda: None, torn_tail=False):
    """Read a feed file, up to end (a line boundary; None: all of it), into a FeedSummary.
    ValueError names a damaged line (fsck --repair first), and a torn last line unless torn_tail
    (a server may be writing it: it is left out, but for its number); pause() is called every few
    hundred lines (a background compaction lets other threads in, or stops)."""
    summary = FeedSummary()
    with open_data_file(path) as f:
        for line_number, offset, line, number, kind, _, session, problem, last in scan_feed(f):
            if line_number % PAUSE_LINES == 0:
                pause()
            if end is not None and offset >= end:
                break
            if line_number % PAUSE_LINES == 0:  # (before any `continue`: every line counts)
                pause()
            if problem is not None and last and torn_tail:
                summary.end = lost_number(line, summary.end)
                break
            if problem is not None:
                raise ValueError("%s:%d: %s" % (path, line_number, problem))
            summary.lines += 1
            summary.end = number
            summary.size = offset + len(line)
            if kind == b"x":
                summary.erased += 1
                continue
            summary.events += 1
            if kind == b"r":
                summary.records += 1
            else:
                old = summary.winners.get(session[0])
                if old is not None:
                    summary.superseded_bytes += old[1]
                summary.winners[session[0]] = (number, len(line), session[2], session[3])
    return summary


class CompactionPlan:
    """What a compaction does to a feed (plan_compaction): from its FeedSummary, the sessions whose
    records go (erase) and the deleted sessions whose winning line gets the time it is first seen
    (stamp), at now_ms."""

    __slots__ = ("summary", "erase", "stamp", "now_ms")

    def __init__(self, summary, erase, stamp, now_ms):
        self.summary = summary
        self.erase = erase
        self.stamp = stamp
        self.now_ms = now_ms

    def restamp(self, winners):
        """Give the winning lines it stamped their time in a feed's winners (session id -> (number,
        size, deleted, stored)), where no later line has won since."""
        for session_id in self.stamp:
            number, size, deleted, _ = winners[session_id]
            if number == self.summary.winners[session_id][0]:
                winners[session_id] = (number, size + len(b',"t":%d' % self.now_ms), deleted,
                                       self.now_ms)

    def drops(self):
        """Whether it drops or changes a line at all."""
        return bool(self.erase or self.stamp or self.summary.superseded_bytes)

    def outcome(self, path, pause=lambda: None):
        """(bytes kept, records erased): known from the summary unless records are erased, which
        takes reading them (compact_lines) to count."""
        if self.erase:
            return compact_lines(path, self, pause=pause)[:2]
        summary = self.summary
        return (summary.size - summary.superseded_bytes
                + len(self.stamp) * len(b',"t":%d' % self.now_ms)), 0


def plan_compaction(summary, now_ms, retain_ms):
    """The CompactionPlan of a feed: a session goes once its winning metadata is a deletion stored
    retain_ms or longer ago; a deletion stored before lines had times is timed from now."""
    erase, stamp = set(), set()
    for session_id, (_, _, deleted, stored) in summary.winners.items():
        if deleted and stored is None:
            stamp.add(session_id)
        elif deleted and now_ms - stored >= retain_ms:
            erase.add(session_id)
    return CompactionPlan(summary, erase, stamp, now_ms)


def compact_lines(path, plan, out=None, pause=lambda: None):
    """Read a feed file's first plan.summary.size bytes and write what the plan keeps to out
    (None: only count it): (bytes kept, records erased now, the FeedIndex of what was written)."""
    summary, erase, stamp, now_ms = plan.summary, plan.erase, plan.stamp, plan.now_ms
    index, kept, erased = FeedIndex(), 0, 0
    with open_data_file(path) as f:
        for line_number, offset, line, number, kind, key, session, problem, _ in scan_feed(f):
            if offset >= summary.size:
                break
            if line_number % PAUSE_LINES == 0:  # (before the `continue` of a dropped line)
                pause()
            if problem is not None:
                raise ValueError("%s:%d: %s" % (path, line_number, problem))
            if kind == b"s":
                if number != summary.winners[session[0]][0]:
                    continue  # superseded: dropped
                if session[0] in stamp:
                    line = feed_line(number, b"s", parse_feed_line(line)[4], stored=now_ms)
            elif kind == b"r" and erase and record_session(parse_feed_line(line)[4]) in erase:
                line, kind, erased = feed_line(number, b"x", key=key), b"x", erased + 1
            if out is not None:
                out.write(line)
            index.add(number, len(line), kind != b"x")
            kept += len(line)
    return kept, erased, index


def compact_file(path, now_ms, retain_ms):
    """Compact one feed file no server is using: write what is kept aside, fsync it, rename it over
    the feed, fsync the directory. (bytes before, bytes after, records erased)."""
    plan = plan_compaction(summarize_feed(path), now_ms, retain_ms)
    if not plan.drops():
        return plan.summary.size, plan.summary.size, 0
    aside = aside_path(path)
    try:
        with open_aside(path) as out:
            kept, erased, _ = compact_lines(path, plan, out)
            out.flush()
            if kept == plan.summary.size and not erased:  # (records erased before, say)
                _remove(aside)
                sync_dir(os.path.dirname(path))
                return kept, kept, 0
            sync_file(out.fileno())
        os.replace(aside, path)
    except BaseException:
        if _remove(aside):
            sync_dir(os.path.dirname(path))
        raise
    sync_dir(os.path.dirname(path))
    return plan.summary.size, kept, erased


def open_aside(path):
    """The file a rewrite of the feed file path is written to (aside_path) until it replaces it,
    made afresh with path's mode, not this process's umask's: a feed stays unreadable to other
    users (0600, as the server makes it). (It is the data dir owner's: root works as them.) A new
    file, never one found there (a link, say): one a crash left is removed first."""
    fd = open_in_data_dir(path, os.O_RDONLY)
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    _remove(aside_path(path))
    fd = open_in_data_dir(aside_path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        keep_mode(fd, info.st_mode & 0o7777)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _remove(path):
    """Unlink path (a link as itself); whether there was one."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_tree(path):
    """Remove a directory and all it holds, durably: each directory is fsynced once its entries
    are gone, and the parent once it is. No link is followed (one is removed as itself)."""
    for entry in list(os.scandir(path)):
        if entry.is_dir(follow_symlinks=False):
            remove_tree(entry.path)
        else:
            os.unlink(entry.path)
    sync_dir(path)
    os.rmdir(path)
    sync_dir(os.path.dirname(path))


class StorageLimits:
    """What a write may not pass: its principal's storage quota (in a PrincipalList, swapped on
    SIGHUP), against what they store (the Metrics count it by owner), and the disk's reserve (a
    DiskReserve). FeedStore.push and MemoryStore.commit ask check() before they write anything."""

    def __init__(self, metrics, principals=None, disk=None):
        self.metrics = metrics
        self.principals = principals
        self.disk = disk

    def check(self, principal, adding, writing=None):
        """StorageQuotaExceeded when principal (None: no quota applies) would pass their quota by
        adding bytes (a write that adds nothing passes); DiskLow when writing bytes (default:
        adding) would leave the disk less than its reserve."""
        if principal is not None and self.principals is not None and adding > 0:
            quota = self.principals.quotas.get(principal)
            if quota is not None:
                stored = self.metrics.stored(principal)
                if stored + adding > quota:
                    raise StorageQuotaExceeded(quota, stored)
        if self.disk is not None:
            self.disk.check(adding if writing is None else writing)


def disk_free(path):
    """The bytes an unprivileged writer may still use on path's file system (one statvfs)."""
    return shutil.disk_usage(path).free


def default_reserve(path):
    """--reserve-disk's default for path's file system: the larger of 256 MiB and 2% of it."""
    return max(DEFAULT_RESERVE_BYTES, int(shutil.disk_usage(path).total * DEFAULT_RESERVE_SHARE))


class DiskReserve:
    """--reserve-disk: the free bytes a write must leave on the data dir's disk, so that a full
    card never takes the OS down with it.

    free() (a statvfs, about 2 us) is asked at most once every DISK_CHECK_SECONDS; between two
    looks, what was let in since is taken off its answer, so a burst of pushes cannot run past the
    reserve on a stale figure. The first refusal is logged, and so is the look that finds room
    for any push again (MAX_PUSH_BYTES above the reserve); `low` says which holds, for /metrics.
    """

    def __init__(self, path, reserve, log, free=None, clock=time.monotonic):
        self.path = path
        self.reserve = reserve
        self.log = log
        self.free = free or (lambda: disk_free(path))
        self.clock = clock
        self.low = False
        self._lock = threading.Lock()
        self._next_look = float("-inf")        # when free() is to be asked again
        self._room = 0                         # its answer, less what was let in since

    def check(self, writing):
        """Let writing bytes in, or DiskLow when they would leave less than the reserve."""
        with self._lock:
            if self.clock() >= self._next_look:
                self._look()
            if self._room - writing < self.reserve:
                if not self.low:
                    self.low = True
                    self.log("the disk of %s is down to its reserve (%s free, %s kept): pushes "
                             "and memory commits are refused until there is room; reads and "
                             "compaction go on" % (self.path, format_bytes(max(self._room, 0)),
                                                   format_size(self.reserve)))
                raise DiskLow(self._room, self.reserve)
            self._room -= max(writing, 0)

    def is_low(self):
        """Whether writes are being refused (looked at again if it is time): a gauge."""
        with self._lock:
            if self.clock() >= self._next_look:
                self._look()
            return int(self.low)

    def _look(self):
        """Ask free(), and again no sooner than DISK_CHECK_SECONDS from now (lock held)."""
        self._next_look, self._room = self.clock() + DISK_CHECK_SECONDS, self.free()
        if self.low and self._room >= self.reserve + MAX_PUSH_BYTES:
            self.low = False
            self.log("the disk of %s has room again (%s free, %s kept): pushes and memory "
                     "commits go ahead" % (self.path, format_bytes(self._room),
                                           format_size(self.reserve)))


def push_bytes(records, sessions):
    """What a push adds to a feed file, at most (what it finds there already adds nothing)."""
    size = FEED_LINE_FRAMING * (len(records) + len(sessions))
    for entry in records:  # (loops: a push's every microsecond counts)
        size += len(entry.event)
    for entry in sessions:
        size += len(entry.event)
    return size


def read_feed(f, path, log):
    """What a Feed keeps in memory of the feed file f (at path): (FeedIndex, the records' dedupe
    keys, each session's winning (gen, updatedAt), each session's winner as (number, size,
    deleted, stored), the bytes of metadata lines a later winner replaced). A torn last line is
    cut off (its number stays used, logged); FeedDamaged names a damaged line before the last."""
    index, keys, meta, winners, superseded = FeedIndex(), set(), {}, {}, 0
    for line_number, offset, line, number, kind, key, session, problem, last in scan_feed(f):
        if problem is not None:
            if not last:
                raise FeedDamaged("%s:%d: %s" % (path, line_number, problem))
            number = lost_number(line, index.end)
            cut_tail(path, offset, number)
            index.add(number, len(feed_line(number, b"x")), event=False)
            log("cut a torn last line off %s (line %d; its number %d stays used)"
                % (path, line_number, number))
            break
        index.add(number, len(line), event=kind != b"x")
        if key is not None:
            keys.add(key)
        if session is not None:
            session_id, stamp, deleted, stored = session
            old = winners.get(session_id)
            if old is not None:
                superseded += old[1]
            meta[session_id] = stamp
            winners[session_id] = (number, len(line), deleted, stored)
    return index, keys, meta, winners, superseded


class Feed:
    """One (owner, project) feed: its file, and the index a start-up rebuilds from it.

    In memory: where each line starts and which number it holds (FeedIndex), the dedupe keys of
    its records (erased ones too), the winning (gen, updatedAt) of each session and where that
    line is. Pushes to a feed share fsyncs (group commit): a push queues its lines; the push that
    finds no flush under way writes every queued line with one write and one fsync, and the others
    wait on a Condition for the flush that holds theirs (the lock hand-off is explained at
    _flush). A parked long-poll waits on a Condition of its own (its FeedWaiter), which the feed
    keeps until events become durable and then hands to wake_waiters. A compaction (compact)
    rewrites the file aside while all this goes on, and swaps it in under the lock. Its FeedStore
    evicts it when no request uses it and room is needed for another: a Feed made again for it
    loads all this from the file.
    """

    def __init__(self, path, owner, log, metrics, clock=time.time, start=0):
        self.path = path
        self.owner = owner                     # what its bytes are counted under in the Metrics
        self.log = log
        self.clock = clock                     # stamps session metadata with the time it is stored
        self.metrics = metrics
        self.bytes_at_load = 0                 # the file's size before it was loaded
        self.lock = threading.Lock()           # guards everything below
        self.waiters = set()                   # FeedWaiters waiting for the next durable event
        self._load_lock = threading.Lock()
        self._flushing = False                 # a push is writing and fsyncing queued batches
        self.loaded = False
        self.damage = None                     # "file:line: reason" once a damaged line is found
        self.index = FeedIndex(start)          # start: a purged feed of the name ended there
        self.keys = set()
        self.meta = {}                         # session id -> (gen, updatedAt) of its winner
        self.winners = {}                      # session id -> (number, size, deleted, stored)
        self.superseded_bytes = 0              # of metadata lines a later winner replaced
        self.erased = set()                    # sessions a compaction erased the records of
        self.next_number = start + 1
        self.pending = []
        self.fd = None
        self.version = 0                       # one more at each compaction: new pages
        self._last_page = None                 # ((since, limit, end, version), Page), the latest
        self._readers = 0                      # reads of the file outside the lock, now
        self._retired = []                     # fds a compaction replaced, closed once unread
        self.fsyncs = 0                        # group commits that wrote events
        self.fsynced_pushes = 0                # pushes made durable by them
        self.users = 0                         # requests holding it in memory (FeedStore.using)

    # -- loading -----------------------------------------------------------

    def ensure_loaded(self):
        if not self.loaded:
            with self._load_lock:
                if not self.loaded and self.damage is None:
                    try:
                        self._load()
                    except OSError as exc:
                        # E.g. out of file descriptors: try again on the next request.
                        raise StorageError("cannot read %s: %s"
                                           % (self.path, reason(exc))) from None
        if self.damage is not None:
            raise FeedDamaged(self.damage)

    def _load(self):
        """Rebuild the index from the file. It is built aside and kept only when the whole load
        succeeds, so a failure half-way (a read error, no file descriptor left) leaves nothing
        half-built. A compaction's file left aside by a crash is removed."""
        if _remove(aside_path(self.path)):
            sync_dir(os.path.dirname(self.path))
        try:
            f = open_data_file(self.path)
        except FileNotFoundError:
            self.loaded = True
            return
        except LinkRefused as exc:
            self.damage = "%s: %s" % (exc.filename, exc.strerror)
            self.log("a link in the data dir: %s" % self.damage)
            return
        with f:
            self.bytes_at_load = os.fstat(f.fileno()).st_size
            try:
                index, keys, meta, winners, superseded = read_feed(f, self.path, self.log)
            except FeedDamaged as exc:
                self.damage = str(exc)
                self.log("a damaged feed: %s: its pushes and pulls are refused until fsck "
                         "--repair mends it" % self.damage)
                return
        fd = open_in_data_dir(self.path, os.O_RDWR | os.O_APPEND)
        with self.lock:
            self.index, self.keys, self.meta, self.winners = index, keys, meta, winners
            self.superseded_bytes = superseded
            self.next_number = index.end + 1
            self.fd = fd
        self.metrics.add("feed_bytes", self.owner, amount=index.offsets[-1] - self.bytes_at_load)
        self.loaded = True

    # -- appending ---------------------------------------------------------

    def append(self, records, sessions):
        """Add new records and winning metadata; (cursor, accepted) once they are durable,
        StorageError when they cannot be. Blocks until the group commit that holds them has
        fsynced."""
        self.ensure_loaded()
        woken = ()
        with self.lock:
            batch = self._queue(records, sessions)
            if batch is None:
                return self.index.end, 0
            while batch.outcome is None:
                if self._flushing:
                    if batch.woken is None:
                        batch.woken = threading.Condition(self.lock)
                    batch.woken.wait()
                else:
                    woken = self._flush()
        if woken:
            wake_waiters(woken, self.log)
            self.metrics.add("woken", amount=len(woken))
        if isinstance(batch.outcome, Exception):
            raise batch.outcome
        return batch.outcome

    def _queue(self, records, sessions):
        """Number the new events and queue them as a batch (lock held); None when nothing need
        wait."""
        batch = _Batch()
        number = self.next_number
        for record in records:
            if record.key in self.keys:
                batch.skipped_keys.append(record.key)
                continue
            self.keys.add(record.key)
            batch.keys.append(record.key)
            batch.lines.append(feed_line(number, b"r", record.event, key=record.key))
            number += 1
        stored = None
        for entry in sessions:
            old = self.meta.get(entry.session_id)
            if not metadata_wins(entry.stamp, old):
                batch.skipped_meta.append((entry.session_id, entry.stamp))
                continue
            self.meta[entry.session_id] = entry.stamp
            batch.undo_meta.append((entry.session_id, old))
            stored = stored or int(self.clock() * 1000)
            line = feed_line(number, b"s", entry.event, stored=stored)
            batch.lines.append(line)
            batch.winners.append((entry.session_id, (number, len(line), entry.deleted, stored)))
            number += 1
        self.next_number = number
        if not batch.lines and number == self.index.end + 1:
            return None
        # Even an empty batch waits when events are in flight: what it found
        # duplicate may be among them, and may yet fail.
        self.pending.append(batch)
        return batch

    def _flush(self):
        """Write and fsync every queued batch, and settle each one's outcome; the FeedWaiters to
        wake.

        Called with the lock held, which it lets go for the disk work and takes again before it
        returns: pushes that arrive meanwhile queue their batches for the next flush (the push that
        finds no flush under way does it: append's loop), and reads go on. _flushing tells them one
        is under way (and a compaction waits for it to end before it swaps files)."""
        group, self.pending = self.pending, []
        lines = [line for queued in group for line in queued.lines]
        self._flushing = True
        self.lock.release()
        failure, seconds, data = None, 0.0, b""
        try:
            if lines:
                data = b"".join(lines)
                seconds = self._write(data)
        except Exception as exc:  # whatever it is, every push of the group must get its outcome
            failure = exc
        finally:
            self.lock.acquire()
            self._flushing = False
        if failure is None:
            index = self.index
            for line in lines:  # numbered from the end on, in this order (_queue)
                index.add(index.end + 1, len(line))
            for queued in group:
                queued.outcome = (index.end, len(queued.lines))
                for session_id, winner in queued.winners:
                    old = self.winners.get(session_id)
                    if old is not None:
                        self.superseded_bytes += old[1]
                    self.winners[session_id] = winner
            if lines:
                pushes = sum(1 for queued in group if queued.lines)
                sessions = sum(len(queued.winners) for queued in group)
                self.fsyncs += 1
                self.fsynced_pushes += pushes
                self.metrics.group_commit(pushes, len(lines) - sessions, sessions, seconds)
                self.metrics.add("feed_bytes", self.owner, amount=len(data))
                woken, self.waiters = self.waiters, set()
        else:
            group += self.pending  # numbered after the failed events: they fail with them
            self.pending = []
            for queued in reversed(group):
                queued.undo(self.keys, self.meta)
            self.next_number = self.index.end + 1
            self.log("push to %s failed: %s" % (self.path, reason(failure)))
            outcome = StorageError("storage failure: %s" % reason(failure))
            for queued in group:
                # A push that added nothing fails only when what it found there was in the failed
                # write.
                held = not queued.lines and queued.still_there(self.keys, self.meta)
                queued.outcome = (self.index.end, 0) if held else outcome
        for queued in group:
            if queued.woken is not None:
                queued.woken.notify()
        if self.pending:
            # Queued meanwhile (so waiting): its push flushes the next group.
            self.pending[0].woken.notify()
        return woken if failure is None and lines else ()

    def _write(self, data):
        """Append data and fsync it; the seconds that took. On failure, cut the file back to its
        durable end."""
        created = self.fd is None
        if created:
            make_dirs(os.path.dirname(self.path))
            self.fd = open_in_data_dir(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        durable_end, started = self.index.offsets[-1], time.monotonic()
        try:
            write_all(self.fd, data)
            sync_file(self.fd)
            if created:
                sync_dir(os.path.dirname(self.path))
            return time.monotonic() - started
        except OSError:
            try:
                os.ftruncate(self.fd, durable_end)
                if created:
                    os.close(self.fd)
                    self.fd = None
                    os.unlink(self.path)
            except OSError as exc:
                self.damage = ("%s: a failed write could not be undone (%s); restart the server"
                               % (self.path, exc))
            raise

    def keep_number(self, number):
        """Make number used, durably, by a line that holds no event, so the feed numbers on after
        it (a restore's jump, made before the server serves); False when the feed is past it
        already."""
        self.ensure_loaded()
        with self.lock:
            if self.index.end >= number:
                return False
            line = feed_line(number, b"x")
            self._write(line)
            self.index.add(number, len(line), event=False)
            self.next_number = number + 1
        return True

    # -- reading -----------------------------------------------------------

    def read(self, since, limit):
        """The Page of at most limit events after cursor since."""
        self.ensure_loaded()
        # Without the lock: every pull one push woke asks for this page at once.
        last = self._last_page
        if last is not None and last[0] == (since, limit, self.index.end, self.version):
            return last[1]  # (a page is built for one end, and never changes)
        with self.lock:
            key = (since, limit, self.index.end, self.version)
            last = self._last_page
            if last is not None and last[0] == key:
                return last[1]
            start, stop, cursor, more = self.index.page(since, limit)
            if start == stop:
                return Page(since)
            first, end = self.index.offsets[start], self.index.offsets[stop]
            fd = self.fd
            self._readers += 1
        try:
            data = read_exactly(fd, first, end - first, self.path)
        finally:
            with self.lock:
                self._readers -= 1
            if self._retired:
                self._close_retired()
        records, sessions = split_events(data)
        page = Page(cursor, records, sessions, more)
        if end - first <= CACHED_PAGE_BYTES:  # a catch-up's big pages are read once: not kept
            self._last_page = (key, page)
        return page

    def add_waiter(self, waiter, since, stopping):
        """Keep waiter until the next durable event, unless there is an event after since already
        or stopping is set: then True, and it is not kept."""
        self.ensure_loaded()
        with self.lock:
            if self.index.last_event > since or stopping.is_set():
                return True
            self.waiters.add(waiter)
        return False

    def drop_waiter(self, waiter):
        with self.lock:
            self.waiters.discard(waiter)

    def wake(self):
        """Wake every waiter, to look at stopping (shutdown)."""
        with self.lock:
            woken, self.waiters = self.waiters, set()
        wake_waiters(woken, self.log)

    # -- compacting --------------------------------------------------------

    def compact(self, now_ms, retain_ms, pause=lambda: None):
        """Compact the file while pushes and pulls go on: what is durable now is read and what a
        compaction keeps written aside, then, under the lock and with no flush under way, the lines
        made durable meanwhile are copied over, the new file fsynced and renamed over the feed's,
        and the directory fsynced. A crash at any moment leaves the old file or the new one whole.
        (bytes before, bytes after, records erased); OSError or ValueError when it could not be."""
        self.ensure_loaded()
        with self.lock:
            durable_end, lines = self.index.offsets[-1], self.index.lines
        plan = plan_compaction(summarize_feed(self.path, durable_end, pause), now_ms, retain_ms)
        aside = aside_path(self.path)
        try:
            with open_aside(self.path) as out:
                _, erased, index = compact_lines(self.path, plan, PacedWriter(out), pause)
                out.flush()
                sync_file(out.fileno())
            while True:
                with self.lock:
                    if not self._flushing:
                        size = self.index.offsets[-1]
                        self._swap(aside, index, lines, durable_end)
                        self.superseded_bytes -= plan.summary.superseded_bytes
                        plan.restamp(self.winners)
                        self.erased |= plan.erase
                        # Still under the lock: no push is answered from the new file before its
                        # name is durable. Should this fail, the feed is on the new file already.
                        sync_dir(os.path.dirname(self.path))
                        break
                time.sleep(0.001)  # a flush is writing to the old file: after it
        except BaseException:
            if _remove(aside):
                sync_dir(os.path.dirname(self.path))
            raise
        self._close_retired()  # (the old file goes as its last fd closes: not under the lock)
        self.metrics.add("feed_bytes", self.owner, amount=index.offsets[-1] - size)
        return size, index.offsets[-1], erased

    def _swap(self, aside, index, lines, durable_end):
        """Make the file written aside the feed's (lock held, no flush under way): copy the lines
        made durable since durable_end to it, fsync, rename, index them (the caller fsyncs the
        directory). Once renamed, the feed is on the new file whatever fails next: appending to the
        old one would lose what a push is answered for."""
        tail = read_exactly(self.fd, durable_end, self.index.offsets[-1] - durable_end, self.path)
        with open_data_file(aside, os.O_WRONLY | os.O_APPEND) as out:
            out.write(tail)
            out.flush()
            sync_file(out.fileno())
        # before the rename: the same file after it
        fd = open_in_data_dir(aside, os.O_RDWR | os.O_APPEND)
        try:
            os.replace(aside, self.path)
        except BaseException:
            os.close(fd)
            raise
        for i in range(lines, self.index.lines):
            index.add(*self.index.line(i))
        self._retired.append(self.fd)  # a read outside the lock may still use it
        self.fd, self.index = fd, index
        self.version += 1
        self._last_page = None

    def close(self):
        """Close the file, and those a compaction replaced (no request uses the Feed: its store
        evicts it)."""
        with self.lock:
            fds, self.fd, self._retired = [self.fd] + self._retired, None, []
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def _close_retired(self):
        """Close the fds a compaction replaced once no read uses them (not under the lock: closing
        the last fd of a replaced file frees it, which may take the disk a while)."""
        with self.lock:
            if self._readers:
                return
            retired, self._retired = self._retired, []
        for fd in retired:
            os.close(fd)


class PacedWriter:
    """A compaction's new file, fsynced every COMPACT_SYNC_BYTES as it is written: its last fsync,
    just before the swap, is then short, and pushes to the feed are not held back for long at once
    by the disk writing back a whole file."""

    def __init__(self, f):
        self.f = f
        self.unsynced = 0

    def write(self, data):
        self.f.write(data)
        self.unsynced += len(data)
        if self.unsynced >= COMPACT_SYNC_BYTES:
            self.f.flush()
            sync_file(self.f.fileno())
            self.unsynced = 0


def read_exactly(fd, offset, size, path):
    """size bytes of fd from offset; StorageError when the file is shorter."""
    chunks, position, stop = [], offset, offset + size
    while position < stop:
        chunk = os.pread(fd, stop - position, position)
        if not chunk:
            raise StorageError("%s is shorter than its index" % path)
        chunks.append(chunk)
        position += len(chunk)
    return b"".join(chunks)


def purged_key(owner, project):
    """How the purged-feeds file names a feed: a hash, so that it lists no one's ids."""
    kind, owner_id = owner
    return hashlib.sha256(("%s\n%s\n%s" % (kind, owner_id, project)).encode("utf-8")).hexdigest()


def read_purged(layout):
    """{purged_key: the last number the feed had} of the feeds purge removed; {} when none was."""
    try:
        with open_data_file(layout.purged) as f:
            doc = decode_json(f.read())
    except FileNotFoundError:
        return {}
    if not isinstance(doc, dict) or not all(as_safe_int(end) is not None for end in doc.values()):
        raise ValueError("%s is not a purged-feeds file" % layout.purged)
    return doc


def read_feed_floor(layout):
    """The number every feed numbers on after since the last restore (0 when none was)."""
    try:
        with open_data_file(layout.feed_floor) as f:
            doc = decode_json(f.read())
    except FileNotFoundError:
        return 0
    floor = doc.get("floor") if isinstance(doc, dict) else None
    if set(doc) != {"floor"} or as_safe_int(floor) is None:
        raise ValueError("%s is not a feed-numbering file" % layout.feed_floor)
    return floor


def is_there(path):
    """Whether there is a file at path; StorageError when that cannot be told (a directory on its
    way this process may not search): never a feed taken for missing, its pull for empty."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StorageError("cannot read %s: %s" % (path, reason(exc))) from None
    return True


def has_event(path):
    """Whether a feed file's first line is an event (the usual case; else it takes a load to
    tell)."""
    try:
        with open_data_file(path) as f:
            return parse_feed_line(f.readline(MAX_PUSH_BYTES * 2))[1] != b"x"
    except (OSError, ValueError):
        return False


def open_feeds_budget():
    """How many feed files may be open at once: a quarter of the process's open-file limit (the
    rest is for connections, the token file, manifests and TLS), and at most MAX_OPEN_FEEDS."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource is not None else -1
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft < 0:
        return MAX_OPEN_FEEDS
    return max(1, min(MAX_OPEN_FEEDS, soft // 4))


class FeedStore:
    """All feeds under DIR/feeds, loaded lazily on first use, at most max_open of them at once
    (default: open_feeds_budget()).

    An owner is ("u", principal) for a personal feed or ("t", team) for a team
    feed: two namespaces, so a principal and a team with one id never meet.

    A Feed in memory holds its file open and its index; to make room for another, the least
    recently used one that no request holds (using) is evicted: its file closed, its index
    dropped, its waiters set aside to wait for the Feed made next for it (as for a feed that
    does not exist yet), which loads the index again from the file. When every one is held, a
    request that needs another waits for one to be let go.
    """

    def __init__(self, data_dir, log, metrics, clock=time.time, max_open=None):
        self.layout = DataDir(data_dir)
        self.log = log
        self.clock = clock
        self.metrics = metrics
        self.limits = StorageLimits(self.metrics)
        self.max_open = max_open or open_feeds_budget()
        self.stopping = threading.Event()
        self._feeds = OrderedDict()            # (owner, project) -> Feed, least recently used 1st
        self._lock = threading.Lock()
        self._let_go = threading.Condition(self._lock)  # a held Feed was let go
        self._waiting = 0                      # requests waiting for it (_make)
        # (owner, project) without a Feed (none yet, or evicted) -> FeedWaiters waiting for one
        self.waiters_aside = {}
        self._purged = None                    # read_purged, when a new feed is first made
        self._floor = 0                        # read_feed_floor, read with it
        self._damaged = {}                     # (owner, project) -> an evicted Feed's damage
        # What evicted Feeds counted: pushes made durable, fsyncs that did it.
        self._evicted_counts = [0, 0]

    def feed(self, owner, project, create=False, hold=False):
        """The Feed of (owner, project), made when none is in memory; None when it has no file and
        create is false. A Feed not held may be evicted once it is let go: hold=True holds it
        until release(feed) (using does both).

        create=True makes an in-memory feed only: its file appears with its first event. A feed
        that purge removed numbers on from where it ended.
        """
        key = (owner, project)
        with self._lock:
            feed = self._feeds.get(key)
            if feed is None:
                feed = self._make(key, create)
            else:
                self._feeds.move_to_end(key)
            if feed is not None and hold:
                feed.users += 1
            return feed

    def release(self, feed):
        """Let go of a Feed that feed(hold=True) held."""
        with self._lock:
            feed.users -= 1
            if not feed.users and self._waiting:
                self._let_go.notify()

    @contextlib.contextmanager
    def using(self, owner, project, create=False):
        """The Feed of (owner, project) (or None, as feed()), held for the block."""
        feed = self.feed(owner, project, create, hold=True)
        try:
            yield feed
        finally:
            if feed is not None:
                self.release(feed)

    def _make(self, key, create):
        """A new Feed for key, room made for it (lock held), or the one made while this waited
        for room; None when it has no file and create is false."""
        path = self.layout.feed_path(*key)
        # (lstat: a link is a feed the load refuses, not a feed that is not there)
        if not (create or is_there(path)):
            return None
        deadline = None
        while len(self._feeds) >= self.max_open and key not in self._feeds:
            idle = next((old for old in self._feeds.items() if not old[1].users), None)
            if idle is not None:
                self._evict(*idle)
                continue
            deadline = deadline or time.monotonic() + FEED_ROOM_SECONDS
            self._waiting += 1
            try:
                woken = self._let_go.wait(deadline - time.monotonic())
            finally:
                self._waiting -= 1
            if not woken and time.monotonic() >= deadline:
                raise StorageError("all %d open feeds are in use" % self.max_open)
        feed = self._feeds.get(key)
        if feed is not None:
            return feed
        self._read_numbering()
        if create:
            try:  # (long ids only)
                write_name_files(self.layout.feed_names(*key))
            except OSError as exc:
                raise StorageError("cannot name %s: %s" % (path, reason(exc))) from None
        # Pulls waiting for this feed to exist now wait on it, for its first event: not woken now.
        # A new feed numbers on after a purged one of its name, and after the last restore's jump.
        start = max(self._purged.get(purged_key(*key), 0), self._floor)
        feed = self._feeds[key] = Feed(path, key[0], self.log, self.metrics, clock=self.clock,
                                       start=start)
        feed.waiters.update(self.waiters_aside.pop(key, ()))
        feed.damage = self._damaged.get(key)
        return feed

    def _evict(self, key, feed):
        """Close an idle Feed's file and forget it (lock held); its waiters wait aside."""
        del self._feeds[key]
        with feed.lock:
            waiters, feed.waiters = feed.waiters, set()
        feed.close()
        if waiters:
            self.waiters_aside.setdefault(key, set()).update(waiters)
        if feed.damage is not None:
            self._damaged[key] = feed.damage
        self._evicted_counts[0] += feed.fsynced_pushes
        self._evicted_counts[1] += feed.fsyncs

    def highest_number(self):
        """The highest number any feed has used, purged ones and the last restore's jump too (a
        restore's start: it loads every feed)."""
        highest = 0
        for owner, project, _ in self.layout.all_feeds():
            if owner is not None:
                with self.using(owner, project) as feed:
                    feed.ensure_loaded()
                    highest = max(highest, feed.index.end)
        with self._lock:
            self._read_numbering()
            return max([highest, self._floor] + list(self._purged.values()))

    def number_on_from(self, floor):
        """A restore's jump: every feed numbers on after floor, those on disk (each gets a line
        that holds no event, numbered floor; one past it already is left as it is, so a start that
        crashed half-way does the rest) and those made later (DIR/feeds/restored.json). The
        number of feeds that jumped."""
        jumped = 0
        for owner, project, _ in self.layout.all_feeds():
            if owner is not None:
                with self.using(owner, project) as feed:
                    jumped += feed.keep_number(floor)
        if read_feed_floor(self.layout) < floor:
            make_dirs(self.layout.feeds)
            write_atomically(self.layout.feed_floor, encode_json({"floor": floor}))
        with self._lock:
            self._floor = floor
        return jumped

    def _read_numbering(self):
        """Read the purged-feeds and numbering files, once (lock held)."""
        if self._purged is None:
            path = self.layout.purged
            try:
                purged = read_purged(self.layout)
                path = self.layout.feed_floor
                self._floor = read_feed_floor(self.layout)
            except (OSError, ValueError) as exc:
                raise StorageError("cannot read %s: %s" % (path, reason(exc))) from None
            self._purged = purged

    def feeds(self):
        """The Feeds in memory."""
        with self._lock:
            return list(self._feeds.values())

    def loaded(self):
        """The (owner, project) of the Feeds in memory whose index is loaded."""
        with self._lock:
            return [key for key, feed in self._feeds.items() if feed.loaded]

    def push(self, owner, project, records, sessions):
        """Append a validated push; (cursor, accepted) once durable. A push that adds nothing
        creates nothing (an empty push to a project without a feed leaves no Feed behind
        either). Past the owner's quota (StorageQuotaExceeded), only a push of session deletions
        alone goes ahead: it is what frees room, once a compaction erases their records. Below the
        disk's reserve (DiskLow), none does."""
        if records or sessions:
            deletions = not records and all(entry.deleted for entry in sessions)
            self.limits.check(None if owner[0] != "u" or deletions else owner[1],
                              push_bytes(records, sessions))
        feed = self.feed(owner, project, create=bool(records or sessions), hold=True)
        if feed is None:
            return 0, 0
        try:  # (not `using`: a push's every microsecond counts)
            return feed.append(records, sessions)
        finally:
            self.release(feed)

    def pull(self, owner, project, since, limit):
        """The Page of at most limit events after since. A pull never creates a feed."""
        feed = self.feed(owner, project, hold=True)
        if feed is None:
            return Page(since)
        try:
            return feed.read(since, limit)
        finally:
            self.release(feed)

    def wait(self, owner, project, since, timeout, waiter=None):
        """Wait up to timeout seconds for (owner, project) to have an event after since; True once
        it has, or once the store is stopping. waiter: the FeedWaiter to wait as (its on_event is
        called by the thread that wakes this wait, before it does: see wake_waiters); None: a new
        one.

        A project without a Feed in memory (no feed, or an evicted one) gets none for this: its
        waiters wait aside, and the Feed made for it takes them over. (Long-polls on made-up
        names leave nothing behind.)
        """
        key = (owner, project)
        if waiter is None:
            waiter = FeedWaiter()
        # Held until the wait lets it go: a flush that takes this waiter cannot notify it before.
        with waiter.woken:
            with self.using(owner, project) as feed:
                if feed is not None and feed.add_waiter(waiter, since, self.stopping):
                    return True
                if feed is None:
                    with self._lock:
                        if self.stopping.is_set():
                            return True
                        feed = self._feeds.get(key)
                        if feed is None:
                            self.waiters_aside.setdefault(key, set()).add(waiter)
                    if feed is not None:  # made meanwhile (its file too): not held, but looked at
                        return self.wait(owner, project, since, timeout=timeout, waiter=waiter)
            if not waiter.woken.wait(timeout):
                self._drop_waiter(key, waiter)
        feed = self._feeds.get(key)  # (only looked at: one evicted meanwhile says no)
        return self.stopping.is_set() or (feed is not None and feed.index.last_event > since)

    def _drop_waiter(self, key, waiter):
        """Forget a waiter whose wait is over: aside, or on the Feed made since."""
        with self._lock:
            waiting = self.waiters_aside.get(key)
            if waiting is not None and waiter in waiting:
                waiting.discard(waiter)
                if not waiting:
                    del self.waiters_aside[key]
                return
            feed = self._feeds.get(key)
        if feed is not None:
            feed.drop_waiter(waiter)

    def projects(self, owner):
        """The sorted project ids with a durable event in owner's feed, after a crash too: a feed
        in use counts its events (its file may hold a first push still being fsynced, or being
        undone); another is listed when its first line is an event, else once it is loaded."""
        names = []
        try:
            feeds = self.layout.owner_feeds(owner)
        except OSError as exc:
            raise StorageError("cannot read %s: %s" % (exc.filename, reason(exc))) from None
        for project, entry in feeds:
            feed = self._feeds.get((owner, project))
            if (feed is None or not feed.loaded) and has_event(entry.path):
                names.append(project)
                continue
            with self.using(owner, project) as feed:
                if feed is None:
                    continue  # removed meanwhile
                try:
                    feed.ensure_loaded()
                except (FeedDamaged, StorageError):
                    names.append(project)  # it holds something: its pulls say what is wrong
                    continue
                if feed.index.events:
                    names.append(project)
        return sorted(names)

    def count_bytes(self):
        """Count what each owner's feeds hold on disk, by one walk of DIR/feeds (at start); then
        pushes, compactions and cut torn tails count what they change."""
        for owner, _, entry in self.layout.all_feeds():
            if owner is not None:
                self.metrics.add("feed_bytes", owner,
                                 amount=entry.stat(follow_symlinks=False).st_size)

    def bytes_on_disk(self):
        """What the feeds hold on disk, every owner's."""
        return self.metrics.total("feed_bytes")

    def damaged(self):
        """Feeds refused for a damaged line."""
        with self._lock:
            return len(set(self._damaged).union(
                key for key, feed in self._feeds.items() if feed.damage is not None))

    def commit_counts(self):
        """(pushes made durable, fsyncs that did it) since start: group commit at work."""
        with self._lock:
            feeds = list(self._feeds.values())
            pushes, fsyncs = self._evicted_counts
        return (pushes + sum(feed.fsynced_pushes for feed in feeds),
                fsyncs + sum(feed.fsyncs for feed in feeds))

    def stop(self):
        """Wake every waiter to answer now (shutdown)."""
        self.stopping.set()
        with self._lock:
            feeds = list(self._feeds.values())
            unborn = [waiter for waiters in self.waiters_aside.values() for waiter in waiters]
            self.waiters_aside.clear()
        wake_waiters(unborn, self.log)
        for feed in feeds:
            feed.wake()


class Compactor:
    """Compacts feeds in use in the background: every COMPACT_CHECK_SECONDS it looks at the
    feeds loaded in memory, and compacts, one at a time, each whose droppable bytes are at least
    half its file and at least COMPACT_MIN_BYTES, when the disk has room for the new file.

    What a feed can drop is known without reading it while it is only superseded metadata; a
    deletion past the retention window takes a reading to count its records, done again only
    once the file has grown by COMPACT_MIN_BYTES.
    """

    def __init__(self, store, retain_days, log, clock=time.time):
        self.store = store
        self.retain_ms = retain_days * DAY_MS
        self.log = log
        self.clock = clock
        self._looked = {}                      # a feed's path -> its size when last counted
        self._stopped = threading.Event()
        self._thread = None

    def pause(self):
        """Called every PAUSE_LINES lines of a compaction: other threads have the interpreter for a
        moment (a push waits no longer than one piece), and a stop ends the compaction, which
        leaves the feed as it was."""
        time.sleep(0.0001)  # (sleep(0) lets go of the interpreter, but takes it again at once)
        if self._stopped.is_set():
            raise CompactionStopped()

    def start(self):
        self._thread = threading.Thread(target=self._run, name="compactor", daemon=True)
        self._thread.start()

    def stop(self):
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self):
        while not self._stopped.wait(COMPACT_CHECK_SECONDS):
            try:
                self.run_once()
            except CompactionStopped:
                return
            except Exception as exc:  # it must live on, as the server does
                self.log("compactor: %s: %s" % (type(exc).__name__, exc))

    def run_once(self):
        """Look at every feed in use once; compact those worth it."""
        for owner, project in self.store.loaded():
            if self._stopped.is_set():
                return
            with self.store.using(owner, project) as feed:  # (not evicted while compacted)
                if (feed is not None and feed.loaded and feed.damage is None
                        and feed.fd is not None):
                    self._consider(feed)
        for path in set(self._looked) - {feed.path for feed in self.store.feeds()}:
            del self._looked[path]

    def _consider(self, feed):
        size, now_ms = feed.index.offsets[-1], int(self.clock() * 1000)
        floor = max(COMPACT_MIN_BYTES, size // 2)
        if size < COMPACT_MIN_BYTES:
            return
        droppable = feed.superseded_bytes
        aged = [session_id for session_id, (_, _, deleted, stored) in list(feed.winners.items())
                if deleted and stored is not None and now_ms - stored >= self.retain_ms
                and session_id not in feed.erased]
        if (droppable < floor and aged
                and size - self._looked.get(feed.path, 0) >= COMPACT_MIN_BYTES):
            self._looked[feed.path] = size
            plan = plan_compaction(summarize_feed(feed.path, size, pause=self.pause), now_ms,
                                   self.retain_ms)
            droppable = plan.summary.size - plan.outcome(feed.path, self.pause)[0]
        if droppable < floor:
            return
        room = shutil.disk_usage(os.path.dirname(feed.path)).free
        if room < size - droppable + COMPACT_MIN_BYTES:
            self.log("compaction of %s waits: the disk has no room for its new file" % feed.path)
            return
        started = time.monotonic()
        try:
            before, after, erased = feed.compact(now_ms, self.retain_ms, pause=self.pause)
        except CompactionStopped:
            raise
        except (OSError, ValueError, StorageError) as exc:
            self.log("compaction of %s failed, the feed is as it was: %s"
                     % (feed.path, reason(exc)))
            return
        self._looked.pop(feed.path, None)
        self.store.metrics.add("compactions")
        self.log("compacted %s: %s -> %s (%s erased) in %.1f s" % (
            feed.path, format_bytes(before), format_bytes(after), plural(erased, "record"),
            time.monotonic() - started))



# -------------------------------------------------------------------------------------------------
# Storage: memory manifests and immutable note revisions
# -------------------------------------------------------------------------------------------------

# An entry's size is its JSON in a full snapshot: {"id":..,"hash":..,"note":..} or
# {"id":..,"hash":null}.
_LIVE_ENTRY_BYTES = len(b'{"id":"","hash":"","note":}') + 64   # + id + the note's JSON
_TOMBSTONE_BYTES = len(b'{"id":"","hash":null}')                # + id
_REVISION = re.compile(r"[0-9a-f]{32}")
_OBJECT_NAME = re.compile(r"[0-9a-f]{32}\.json")


class Manifest:
    """One scope's published state: an etag and its entries by note id.

    An entry is {"hash", "rev", "size"} for a live note (rev names its object file, size is its
    entry's JSON in a full snapshot) or {"hash": None, "deletedAt": ms} for a tombstone. A Manifest
    is never changed once built: a commit builds a new one, so readers may keep using the old one.
    """

    __slots__ = ("etag", "entries", "live_count", "entry_bytes", "_sorted_ids", "_fragments",
                 "_etag_json", "_live_hashes", "_all_fragments", "unchanged_snapshot")

    def __init__(self, etag, entries):
        self.etag = etag
        self.entries = entries
        live = 0
        size = 2 + max(len(entries) - 1, 0)  # the brackets and commas of the entries array
        for note_id, entry in entries.items():
            if entry["hash"] is None:
                size += _TOMBSTONE_BYTES + len(note_id)
            else:
                live += 1
                size += entry["size"]
        self.live_count = live
        self.entry_bytes = size
        self._sorted_ids = None
        self._fragments = None
        self._etag_json = None
        self._live_hashes = None
        self._all_fragments = None
        self.unchanged_snapshot = None  # the Snapshot `unchanged`, once asked for

    def etag_json(self):
        """The etag as a JSON value (null when there is no manifest), encoded once per manifest."""
        if self._etag_json is None:
            self._etag_json = encode_json(self.etag)
        return self._etag_json

    def fragments(self):
        """[(id, hash, entry JSON without its note)] sorted by id, built once per manifest."""
        if self._fragments is None:
            fragments = []
            for note_id in self.sorted_ids():
                current = self.entries[note_id]["hash"]
                if current is None:
                    fragments.append((note_id, None,
                                      b'{"id":"%s","hash":null}' % note_id.encode("ascii")))
                else:
                    fragments.append((note_id, current, b'{"id":"%s","hash":"%s"}' % (
                        note_id.encode("ascii"), current.encode("ascii"))))
            self._fragments = fragments
        return self._fragments

    def live_hashes(self):
        """{id: hash} of the live notes, built once per manifest."""
        if self._live_hashes is None:
            self._live_hashes = {note_id: entry["hash"] for note_id, entry in self.entries.items()
                                 if entry["hash"] is not None}
        return self._live_hashes

    def all_fragments(self):
        """Every entry's fragment, joined: the entries of a snapshot for a client that holds every
        note."""
        if self._all_fragments is None:
            self._all_fragments = b",".join(fragment for _, _, fragment in self.fragments())
        return self._all_fragments

    def sorted_ids(self):
        if self._sorted_ids is None:
            self._sorted_ids = sorted(self.entries)
        return self._sorted_ids

    def to_bytes(self):
        entries = {note_id: self.entries[note_id] for note_id in self.sorted_ids()}
        return encode_json({"version": 1, "etag": self.etag, "entries": entries})

    @classmethod
    def from_bytes(cls, data):
        """Parse and check a manifest file; ValueError when it is not one this server wrote.

        The check is strict because rev becomes a file name.
        """
        doc = decode_json(data)
        if (not isinstance(doc, dict) or doc.get("version") != 1
                or set(doc) != {"version", "etag", "entries"}):
            raise ValueError("not a version 1 manifest")
        etag, entries = doc["etag"], doc["entries"]
        if not isinstance(etag, str) or not etag or not isinstance(entries, dict):
            raise ValueError("bad etag or entries")
        for note_id, entry in entries.items():
            if not is_valid_id(note_id) or not isinstance(entry, dict):
                raise ValueError("bad entry")
            if entry.get("hash") is None:
                good = set(entry) == {"hash", "deletedAt"} and _is_count(entry["deletedAt"])
            else:
                good = (set(entry) == {"hash", "rev", "size"} and isinstance(entry["hash"], str)
                        and _HASH.fullmatch(entry["hash"]) is not None
                        and isinstance(entry["rev"], str)
                        and _REVISION.fullmatch(entry["rev"]) is not None
                        and _is_count(entry["size"]))
            if not good:
                raise ValueError("bad entry")
        return cls(etag, entries)


NO_MANIFEST = Manifest(None, {})


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class ManifestCache:
    """The parsed manifests of the most recently used scopes (LRU), keyed by scope directory.

    This process is the only writer of the data directory (it holds its lock), so a cached manifest
    stays true until this process publishes another one.
    """

    def __init__(self, size=MANIFEST_CACHE_SIZE):
        self.size = size
        self._items = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            manifest = self._items.get(key)
            if manifest is not None:
                self._items.move_to_end(key)
            return manifest

    def put(self, key, manifest):
        with self._lock:
            self._items[key] = manifest
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def drop(self, key):
        with self._lock:
            self._items.pop(key, None)


class ScopeFiles:
    """The paths of one scope's directory (DataDir.scope_files): manifest.json,
    objects/<rev>.json."""

    __slots__ = ("root", "manifest", "objects")

    def __init__(self, root):
        self.root = root
        self.manifest = os.path.join(self.root, "manifest.json")
        self.objects = os.path.join(self.root, "objects")

    def object_path(self, rev):
        return os.path.join(self.objects, rev + ".json")


class Snapshot:
    """What a snapshot or commit returns: principal, etag and quota (as JSON bytes), and the
    entries as JSON fragments (or `unchanged`)."""

    __slots__ = ("principal", "etag_json", "quota_json", "entries", "unchanged", "_json")

    def __init__(self, principal, etag_json, quota_json, entries=(), unchanged=False):
        self.principal = principal
        self.etag_json = etag_json
        self.quota_json = quota_json
        self.entries = entries
        self.unchanged = unchanged
        self._json = None

    def to_json(self):
        if self._json is None:  # built once: an `unchanged` snapshot is given again and again
            middle = (b'"unchanged":true' if self.unchanged
                      else b'"entries":[%s]' % b",".join(self.entries))
            self._json = b'{"principal":"%s","etag":%s,%s,"quota":%s}' % (
                self.principal.encode("ascii"), self.etag_json, middle, self.quota_json)
        return self._json


class MemoryStore:
    """Memory notes under DIR/memory: one manifest plus immutable revision objects per scope.

    A commit is a compare-and-swap on the manifest's etag under a lock for its scope; snapshots
    take the same lock, so garbage collection at commit time never removes an object a reader is
    about to open.
    """

    def __init__(self, data_dir, log, metrics, clock=time.time):
        self.layout = DataDir(data_dir)
        self.clock = clock
        self.log = log
        self.log_once = LogOnce(self.log)  # what fails a read
        self.metrics = metrics
        self.limits = StorageLimits(self.metrics)
        self.quota = dict(MEMORY_QUOTA)              # enforced and advertised; tests may lower it
        self._quota_json = (None, b"")               # (the quota it was made from, its JSON)
        self.max_snapshot_bytes = MAX_SNAPSHOT_BYTES
        self.garbage_age = GARBAGE_AGE_SECONDS
        self._cache = ManifestCache()
        self._paths = {}
        self._locks = weakref.WeakValueDictionary()  # a scope's lock lives while someone holds it
        self._locks_guard = threading.Lock()

    def quota_doc(self):
        return dict(self.quota)

    def count_bytes(self):
        """Count what each principal's memory holds on disk, by one walk of DIR/memory (at start);
        then commits and garbage collection count what they change."""
        for principal, path in self.layout.memory_dirs():
            self.metrics.add("memory_bytes", principal, amount=sum(
                os.lstat(os.path.join(root, name)).st_size
                for root, _, names in os.walk(path) for name in names))

    def bytes_on_disk(self):
        """What memory holds on disk, every principal's."""
        return self.metrics.total("memory_bytes")

    def quota_json(self):
        """The quota as answered, encoded once (and again only if it was changed)."""
        made_from, data = self._quota_json
        if made_from != self.quota:
            made_from, data = dict(self.quota), encode_json(self.quota)
            self._quota_json = (made_from, data)
        return data

    def _files(self, principal, scope):
        """The ScopeFiles of (principal, scope), remembered: they are asked for on every
        request."""
        key = (principal, scope.project)  # a scope is its project (None: the user scope)
        files = self._paths.get(key)
        if files is None:
            if len(self._paths) > 10000:
                self._paths.clear()
            # Ids are checked here too: encode_name keeps '/' and '.', so only a valid id is a
            # safe name.
            if (not is_valid_id(principal)
                    or (scope.project is not None and not is_valid_id(scope.project))):
                raise ValueError("invalid principal or project id")
            files = self._paths[key] = self.layout.scope_files(principal, scope)
        return files

    # -- the two operations ------------------------------------------------

    def snapshot(self, principal, scope, known_etag=None, have=None):
        """The Snapshot of principal's scope."""
        files = self._files(principal, scope)
        if known_etag is not None:
            # `unchanged` reads no note, so it needs no scope lock: the cached manifest is the
            # published one (commits replace it under the lock), and the snapshot is true as of
            # this read.
            snapshot = self._unchanged(principal, known_etag, self._cache.get(files.root))
            if snapshot is not None:
                return snapshot
        with self._scope_lock(files.root):
            manifest = self._manifest(files)
            return (self._unchanged(principal, known_etag, manifest)
                    or self._snapshot(principal, files, manifest, have))

    def _unchanged(self, principal, known_etag, manifest):
        """The `unchanged` Snapshot when known_etag is manifest's etag (there being one), else
        None."""
        if manifest is None or known_etag is None or known_etag != manifest.etag:
            return None
        quota_json = self.quota_json()
        snapshot = manifest.unchanged_snapshot  # a scope has one principal: it is the manifest's
        if snapshot is None or snapshot.quota_json is not quota_json:
            snapshot = manifest.unchanged_snapshot = Snapshot(principal, manifest.etag_json(),
                                                              quota_json, unchanged=True)
        return snapshot

    def commit(self, principal, scope, etag, changes, have=None):
        """Apply a list of MemoryChange if etag is still current; the Snapshot with the new
        etag."""
        files = self._files(principal, scope)
        with self._scope_lock(files.root):
            old = self._manifest(files)
            if etag != old.etag:
                self.metrics.add("memory_commits", "conflict")
                raise Conflict("the manifest has changed since that etag")
            entries, objects, fresh = self._apply(old, changes)
            new = Manifest(secrets.token_hex(16), entries)
            self._check_ids(new, changes)
            data = new.to_bytes()
            try:
                self._check_quota(old, new)
                writing = len(data) + sum(len(note) for _, note in objects)
                self.limits.check(principal, writing - _file_size(files.manifest), writing)
            except QuotaExceeded:
                self.metrics.add("memory_commits", "quota")
                raise
            try:  # (long ids only)
                write_name_files(self.layout.scope_names(principal, scope))
            except OSError as exc:
                raise self._sync_failed(files, exc) from None
            self._publish(principal, files, data, objects)
            self.metrics.add("memory_commits", "ok")
            self._cache.put(files.root, new)
            self._mark_replaced(files, old, new)
            self._collect_garbage(principal, files, new)
            return self._snapshot(principal, files, new, have, fresh=fresh)

    def _mark_replaced(self, files, old, new):
        """Touch the revisions this commit stopped using, so garbage collection keeps them for
        garbage_age from now: a backup copying the previous manifest still finds its objects."""
        now = self.clock()
        for note_id, entry in old.entries.items():
            if (entry["hash"] is not None
                    and new.entries.get(note_id, {}).get("rev") != entry["rev"]):
                try:
                    os.utime(files.object_path(entry["rev"]), (now, now))
                except OSError:
                    pass

    def _scope_lock(self, key):
        with self._locks_guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
            return lock

    def _manifest(self, files):
        """The published Manifest of a scope (NO_MANIFEST when there is none), from the cache if
        possible."""
        manifest = self._cache.get(files.root)
        if manifest is not None:
            return manifest
        try:
            with open_data_file(files.manifest) as stream:
                data = stream.read()
        except FileNotFoundError:
            manifest = NO_MANIFEST
        except OSError as exc:
            self.log_once("memory: cannot read %s: %s" % (files.manifest, reason(exc)))
            raise ManifestDamaged("the memory manifest cannot be read") from None
        else:
            try:
                manifest = Manifest.from_bytes(data)
            except ValueError as exc:
                self.log("memory: damaged manifest %s: %s" % (files.manifest, exc))
                raise ManifestDamaged("the memory manifest is damaged") from None
        self._cache.put(files.root, manifest)
        return manifest

    def _snapshot(self, principal, files, manifest, have, fresh=None):
        """The Snapshot of manifest: every entry by id; a note only where have lacks its hash.

        Entries are written as JSON fragments (a stored note's bytes are used as they are, once
        they proved to hash right), so a scope of thousands of notes is sent without building
        objects.
        """
        have = have or {}
        # the client holds every note: no note to send
        if manifest.live_hashes().items() <= have.items():
            return Snapshot(principal, manifest.etag_json(), self.quota_json(),
                            [manifest.all_fragments()])
        fresh = fresh or {}
        entries = []
        for note_id, current, fragment in manifest.fragments():
            if current is None or have.get(note_id) == current:
                entries.append(fragment)
            else:
                note = fresh.get(note_id)
                data = (encode_json(note) if note is not None
                        else self._read_note(files, note_id, manifest.entries[note_id]))
                entries.append(b'%s,"note":%s}' % (fragment[:-1], data))
        return Snapshot(principal, manifest.etag_json(), self.quota_json(), entries)

    def _read_note(self, files, note_id, entry):
        """The stored bytes of a live note, after checking that they hash to the manifest's
        hash."""
        path = files.object_path(entry["rev"])
        try:
            with open_data_file(path) as stream:
                data = stream.read()
        except OSError as exc:
            self.log_once("memory: cannot read note %s at %s: %s" % (note_id, path, reason(exc)))
            raise NoteMissing("a memory note object is missing") from None
        try:
            note = decode_json(data)
            intact = (isinstance(note, dict) and NOTE_FIELDS.issuperset(note)
                      and note_hash(note) == entry["hash"]
                      and encode_json(note) == data)  # exactly the bytes this server wrote
        except (ValueError, KeyError):
            intact = False
        if not intact:
            self.log("memory: note %s at %s does not match its hash" % (note_id, path))
            raise NoteDamaged("a memory note object is damaged")
        return data

    def change_etags(self):
        """Give every scope's manifest a new etag, its entries as they are (a restore: a device
        holding an etag from after the backup gets a Conflict and snapshots again); (scopes
        changed, scopes left as they are for a damaged manifest, which is refused anyway)."""
        changed = damaged = 0
        for principal, scope, files in self.layout.all_scopes():
            with self._scope_lock(files.root):
                try:
                    manifest = self._manifest(files)
                except ManifestDamaged:  # (logged)
                    damaged += 1
                    continue
                if manifest is NO_MANIFEST:
                    continue
                new = Manifest(secrets.token_hex(16), manifest.entries)
                write_atomically(files.manifest, new.to_bytes())
                self._cache.put(files.root, new)
            changed += 1
        return changed, damaged

    # -- committing ----------------------------------------------------------

    def _apply(self, old, changes):
        """The entries after changes, the objects to write [(rev, bytes)] and the new notes by id.

        Expired tombstones are dropped first. Deleting a note that has no entry records a tombstone
        anyway (another device may still hold it); deleting a tombstone keeps its original time.
        """
        now_ms = int(self.clock() * 1000)
        oldest = now_ms - self.quota["tombstoneDays"] * DAY_MS
        entries = {note_id: entry for note_id, entry in old.entries.items()
                   if entry["hash"] is not None or entry["deletedAt"] >= oldest}
        objects, fresh = [], {}
        for change in changes:
            if change.note is None:
                previous = entries.get(change.id)
                if previous is None or previous["hash"] is not None:
                    entries[change.id] = {"hash": None, "deletedAt": now_ms}
                continue
            data = encode_json(change.note)
            rev = secrets.token_hex(16)
            entries[change.id] = {"hash": change.hash, "rev": rev,
                                  "size": _LIVE_ENTRY_BYTES + len(change.id) + len(data)}
            objects.append((rev, data))
            fresh[change.id] = change.note
        return entries, objects, fresh

    @staticmethod
    def _check_ids(new, changes):
        """CaseConflict when a note this commit makes live shares its lower-case id with another
        live note (clients keep notes as files, on disks that may ignore case)."""
        counts = {}
        for note_id, entry in new.entries.items():
            if entry["hash"] is not None:
                folded = note_id.lower()
                counts[folded] = counts.get(folded, 0) + 1
        for change in changes:
            if change.note is not None and counts[change.id.lower()] > 1:
                raise CaseConflict("note ids must differ in more than case")

    def _check_quota(self, old, new):
        """QuotaExceeded when the commit grows a scope beyond maxNotes live notes or its snapshot
        beyond max_snapshot_bytes; a commit that does not grow it is allowed, so a lowered quota
        never locks anyone in."""
        max_notes = self.quota["maxNotes"]
        if new.live_count > max_notes and new.live_count > old.live_count:
            raise QuotaExceeded("more than %d live notes" % max_notes)
        if new.entry_bytes > self.max_snapshot_bytes and new.entry_bytes > old.entry_bytes:
            raise QuotaExceeded("the memory snapshot would be too large")

    def _publish(self, principal, files, data, objects):
        """Write the new objects durably, then replace the manifest (data: its bytes) atomically.

        Any OSError is a CommitFailed, and leaves the previous manifest published.
        """
        written = []
        try:
            make_dirs(files.objects)
            for rev, note in objects:
                path = files.object_path(rev)
                # O_EXCL: a revision is never overwritten.
                fd = open_in_data_dir(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                written.append(path)
                try:
                    write_all(fd, note)
                    sync_file(fd)
                finally:
                    os.close(fd)
            if objects:
                sync_dir(files.objects)
        except OSError as exc:
            for path in written:  # nothing refers to them yet
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise self._sync_failed(files, exc) from None
        # The objects are on disk now, whatever becomes of the manifest: should it fail, garbage
        # collection removes them later, and counts them off then.
        self.metrics.add("memory_bytes", principal, sum(len(note) for _, note in objects))
        old_size = _file_size(files.manifest)
        try:
            write_atomically(files.manifest, data)
        except OSError as exc:
            # Had the rename already happened (a failing directory fsync), the new manifest is the
            # one on disk: forget the cached one so the disk decides, and keep the objects it may
            # refer to.
            self.metrics.add("memory_bytes", principal, _file_size(files.manifest) - old_size)
            self._cache.drop(files.root)
            raise self._sync_failed(files, exc) from None
        self.metrics.add("memory_bytes", principal, len(data) - old_size)

    def _sync_failed(self, files, exc):
        self.log("memory: commit to %s failed: %s" % (files.root, exc))
        return CommitFailed("the memory commit could not be stored")

    def _collect_garbage(self, principal, files, manifest):
        """Remove unreferenced revision objects older than garbage_age (losers of a race, replaced
        revisions, leftovers of a failed commit). A failure here is logged, never raised."""
        referenced = {entry["rev"] + ".json" for entry in manifest.entries.values()
                      if entry["hash"] is not None}
        oldest = self.clock() - self.garbage_age
        removed = 0
        try:
            names = list_data_dir(files.objects)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            self.log("memory: cannot list %s: %s" % (files.objects, exc))
            return 0
        for name in names:
            if name in referenced or not _OBJECT_NAME.fullmatch(name):
                continue
            path = os.path.join(files.objects, name)
            try:
                info = os.lstat(path)  # (a link is removed as itself, never its target)
                if info.st_mtime < oldest:
                    os.unlink(path)
                    removed += 1
                    self.metrics.add("memory_bytes", principal, -info.st_size)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.log("memory: cannot remove %s: %s" % (path, exc))
        if removed:  # (a deleted note's object stays gone after a crash)
            try:
                sync_dir(files.objects)
            except OSError as exc:
                self.log("memory: cannot sync %s: %s" % (files.objects, exc))
        return removed


# A restore: what a server's first start on a copy of a data dir does (apply_restore).
#
# A copy made at some moment (by backup, or another way and marked by hand) lacks what the server
# handed out after it: event numbers, and memory etags, that devices hold. Started as it is, it
# would give the same numbers to new events, and a device whose cursor is past them would skip
# them for good. So the first start on a copy makes every feed number on far past anything handed
# out after the copy was taken: each feed gets a kept number (a line that holds no event) at
# floor = the highest number in the copy + the jump, and a feed made later starts there too. The
# jump is 2**32, plus 1,024 for each millisecond since the copy was taken. A feed takes far fewer
# than 1,024 events a millisecond (a million a second; each push waits for an fsync), so the jump
# passes whatever was handed out between the copy and now, on the server that was lost and on a
# restore of the same copy made earlier; 2**32 is for a clock that went back (no feed takes four
# billion events between a backup and its restore). Numbers must stay under 2**53 (JavaScript's
# safe integers): that leaves room for two million restores of a fresh copy, 97,000 of day-old
# ones, 280 of year-old ones. Memory: every manifest gets a new etag, so a commit with an etag from
# after the copy gets a Conflict and the device snapshots again, to the restored state.

def read_restore_mark(layout):
    """The restore mark of the data dir at layout (None when there is none): {"version": 1,
    "taken": Unix ms, "by": what made it, and once a start has chosen it, "floor": the number every
    feed numbers on after}; ValueError when it is damaged, or says that the archive the copy came
    from was cut short ("whole": false, the first member of a backup archive, which its last member
    replaces)."""
    try:
        with open_data_file(layout.restore_mark) as f:
            mark = decode_json(f.read())
    except FileNotFoundError:
        return None
    if (not isinstance(mark, dict) or mark.get("version") != 1
            or not {"version", "taken", "by"} <= set(mark) <= {"version", "taken", "by", "floor",
                                                                "whole"}
            or as_safe_int(mark["taken"]) is None or not isinstance(mark["by"], str)
            or as_safe_int(mark.get("floor", 0)) is None or mark.get("whole", False) is not False):
        raise ValueError("%s is not a restore mark" % layout.restore_mark)
    if "whole" in mark:
        raise ValueError("the backup archive this copy came from was cut short (%s says so): "
                         "restore a whole one" % layout.restore_mark)
    return mark


def restore_floor(highest, taken_ms, now_ms):
    """Where a restore's feeds number on after: highest + the jump (the comment above says why);
    ValueError when no room is left under 2**53."""
    floor = highest + RESTORE_JUMP + RESTORE_JUMP_PER_MS * max(0, now_ms - taken_ms)
    if floor > MAX_SAFE_INTEGER - RESTORE_JUMP:
        raise ValueError("feed numbers would pass 2**53 (at %d): no room for another restore"
                         % highest)
    return floor


def apply_restore(feeds, memory, log, clock=time.time):
    """A first start on a marked copy: choose the floor (kept in the mark), jump every feed past
    it, give every memory scope a new etag, log one line, then remove the mark. A start that
    crashes half-way does it again with the same floor; a feed that jumped already is left as it
    is. OSError, ValueError, StorageError or FeedDamaged when it cannot be done (the server must
    not start then)."""
    layout = feeds.layout
    mark = read_restore_mark(layout)
    if mark is None:
        return
    if "floor" not in mark:
        mark["floor"] = restore_floor(feeds.highest_number(), mark["taken"],
                                      int(clock() * 1000))
        write_atomically(layout.restore_mark, encode_json(mark))
    jumped = feeds.number_on_from(mark["floor"])
    scopes, damaged = memory.change_etags()
    os.unlink(layout.restore_mark)
    sync_dir(layout.path)
    log("restored from a copy taken %s (%s): feeds number on after %d (%s jumped), %s got a new "
        "etag%s" % (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(mark["taken"] / 1000)),
                    mark["by"], mark["floor"], plural(jumped, "feed"),
                    plural(scopes, "memory scope"),
                    "; %s left as %s: damaged" % (plural(damaged, "scope"),
                                                  "it was" if damaged == 1 else "they were")
                    if damaged else ""))


# -------------------------------------------------------------------------------------------------
# HTTP: requests and responses, the route table, the handlers; then the transport on http.server
# -------------------------------------------------------------------------------------------------
#
# http.server's ThreadingHTTPServer gives every connection a thread, and a BaseHTTPRequestHandler
# subclass reads each request's head once, strictly. A handler simply blocks: a push returns once
# its group commit is fsynced (Feed.append), a long-poll waits on its feed's Condition
# (FeedStore.wait). A watchdog thread keeps the time limits by shutting late sockets down.

class Response:
    """A response: status, body bytes (JSON unless content_type says otherwise), extra headers, and
    whether to close the connection."""
    __slots__ = ("status", "body", "headers", "close", "content_type")

    def __init__(self, status, body, headers=(), close=False, content_type="application/json"):
        self.status = status
        self.body = body
        self.headers = headers                 # a sequence of (name, value)
        self.close = close
        self.content_type = content_type


def json_response(status, value, headers=()):
    return Response(status, encode_json(value), headers)


class Request:
    """What a route's handler sees of one HTTP request: headers by lower-case name, the query
    parsed, and the SyncRequestHandler serving its connection (its method, headers and TLS are
    the handler's): for the body, read only when asked for, and for a parked pull's wait."""
    __slots__ = ("method", "path", "query", "headers", "handler", "client", "tls", "principal",
                 "refusal", "__weakref__")

    def __init__(self, handler, path, query, client):
        self.method = handler.command
        self.path = path
        self.query = query
        self.headers = handler.headers
        self.handler = handler          # read_body; hold, client_gone, respond_early, release
        self.client = client            # the client's address (host), as the connection shows it
        # whether it came over HTTPS (a proxy's HTTPS is not seen)
        self.tls = handler.server.tls is not None
        self.principal = None           # for the access log, once a token was verified
        self.refusal = None             # ... or why it was refused

    def read_body(self, limit):
        """The body, at most limit bytes (BadRequest, TooLarge)."""
        return self.handler.read_body(limit)

    def param(self, name):
        """A query parameter's value, None when absent; 400 when it is given twice."""
        values = self.query.get(name)
        if values is None:
            return None
        if len(values) > 1:
            raise BadRequest("%s is given more than once" % name)
        return values[0]


FRONT_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>oharness-sync</title>
<style>body{font-family:system-ui,sans-serif;max-width:42em;margin:2em auto;padding:0
1em;line-height:1.5}
pre,code{background:#f3f3f3}pre{padding:.8em;overflow:auto}</style>
</head>
<body>
<h1>oharness-sync</h1>
<p>This is an <strong>OHarness sync server</strong>, and it is up:
oharness-sync %(version)s, sync protocol v1.
Its health check is at <a href="/v1/health">/v1/health</a>.</p>
<h2>Point an OHarness client at it</h2>
<p>Put this in your <em>user</em> configuration, <code>~/.oharness/config.json</code> (or
<code>$OHARNESS_HOME/config.json</code>, or on Linux
<code>$XDG_CONFIG_HOME/oharness/config.json</code>, when that is set), then restart OHarness:</p>
<pre>{
  "sync": {
    "url": "%(url)s",
    "token": "ohs_..."
  }
}</pre>
<ul>
<li><code>url</code>: this server's address, as your browser reached it.%(plain)s</li>
<li><code>token</code>: a token from this server's operator
(<code>python3 oharness_sync.py token issue --data DIR --principal YOU</code>).</li>
<li>Only if you share a team's feeds: <code>"team": "ID"</code>, a team the token lists (else
every request is refused). Leave it out for your own sessions.</li>
<li><code>"enabled": false</code> turns sync off without losing the rest; leave it out to
sync.</li>
</ul>
<p>Memory sync (notes) needs more than this token: see this server's README. Session transcripts
and memory notes are shown to nobody here: every other route needs a token.</p>
</body>
</html>
"""


_FORWARDED_PAIR = re.compile(r'\s*(proto|host)\s*=\s*("[^"]*"|[^;,\s]*)', re.IGNORECASE)


def public_url(headers, tls):
    """The address a client should use, as the request shows it: its Host, and https when the
    connection is TLS or a proxy in front says so (Forwarded, X-Forwarded-Proto and -Host). Those
    headers anyone can send: they shape what the front page shows, and decide nothing else.

        Host: sync.example.com:8787                         http://sync.example.com:8787
        ... and X-Forwarded-Proto: https                    https://sync.example.com:8787
        Forwarded: proto=https;host=pi.home.arpa            https://pi.home.arpa
    """
    scheme, host = ("https" if tls else "http"), headers.get("host")
    forwarded = dict((name.lower(), value.strip('"')) for name, value in _FORWARDED_PAIR.findall(
        headers.get("forwarded", "").split(",")[0]))
    proto = (forwarded.get("proto") or headers.get("x-forwarded-proto", "").split(",")[0]).strip()
    if proto.lower() in ("http", "https"):
        scheme = proto.lower()
    host = (forwarded.get("host") or headers.get("x-forwarded-host", "").split(",")[0].strip()
            or host)
    return "%s://%s" % (scheme, host or "HOST")


def forwarded_client(headers):
    """The client address a proxy in front says it serves: the last hop of X-Forwarded-For (the one
    the proxy itself added), else the `for=` of Forwarded's last element; None when neither names
    an IP address (absent, `unknown`, an obfuscated name). Only for a trusted proxy's requests:
    anyone else may send these headers.

        X-Forwarded-For: 203.0.113.9, 198.51.100.7                198.51.100.7
        Forwarded: for=203.0.113.9, for="[2001:db8::7]:4711"      2001:db8::7
    """
    value = headers.get("x-forwarded-for")
    if value is not None:
        hop = value.rsplit(",", 1)[-1]
    else:
        match = _FORWARDED_FOR.search(headers.get("forwarded", "").rsplit(",", 1)[-1])
        if match is None:
            return None
        hop = match.group(1)
    hop = hop.strip(' \t"')
    if hop.startswith("["):                      # [2001:db8::7]:4711
        hop = hop[1:].split("]", 1)[0]
    elif hop.count(":") == 1:                    # 198.51.100.7:4711
        hop = hop.split(":", 1)[0]
    ip = ip_address(hop)
    return None if ip is None else str(ip)


_FORWARDED_FOR = re.compile(r'(?:^|;)\s*for\s*=\s*("[^"]*"|[^;,\s]*)', re.IGNORECASE)


def trusted_proxy(text):
    """The ipaddress network of a --trusted-proxy value (an address or a CIDR); ValueError when it
    is neither."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError("--trusted-proxy %r is not an IP address or a network such as "
                         "10.0.0.0/8" % text) from None


def retry_after(seconds):
    """The header of a response that says when to try again."""
    return [("Retry-After", str(seconds))]


# Where the README says which memory clients this server's --memory-auth lets in.
MEMORY_CLIENT_NOTE = 'the README of oharness-sync, "Pointing an OHarness client at the server"'

# How an error other than an ApiError is answered: on a session route {"error": text}, on a
# memory route {"code", "error": text} (text: %s is the error's own). A token that cannot be
# checked now is 503 on a session route and, as the contract wants, 502 auth_unavailable on a
# memory route. A memory route's 401 names the README's word on memory clients: today's OHarness
# client sends its Cloud account token there. A quota is 507 for a push, 413 for a memory commit;
# the disk's reserve has no memory code of its own.
ERROR_ANSWERS = (  # (exception, session status and text, memory status, code and text)
    (AuthError, 401, "%s", 401, "sign_in_required",
     "%s (which memory clients this server lets in: see " + MEMORY_CLIENT_NOTE + ")"),
    (NotListed, 403, "%s", 403, "account_mismatch", "%s"),
    (AuthThrottled, 429, "%s; try again later", 429, "rate_limited", "%s"),
    (AuthUnavailable, 503, "cannot check this token now (%s); try again later",
     502, "auth_unavailable", "%s"),
    (AuthNotConfigured, 503, "%s", 503, "auth_not_configured", "%s"),
    (QuotaExceeded, 507, "%s", 413, "memory_quota_exceeded", "%s"),
    (DiskLow, 507, "%s", 507, "memory_sync_failed", "%s"),
    (Conflict, 409, "%s", 409, "revision_conflict", "%s"),
    (CaseConflict, 400, "%s", 400, "id_case_conflict", "%s"),
    (ManifestDamaged, 502, "%s", 502, "invalid_manifest", "%s"),
    (NoteMissing, 502, "%s", 502, "missing_memory_object", "%s"),
    (NoteDamaged, 502, "%s", 502, "memory_integrity_error", "%s"),
    (CommitFailed, 502, "%s", 502, "memory_sync_failed", "%s"),
    # (logged once, when the feed was read)
    (FeedDamaged, 500, "this feed is damaged; the server log names the file and line",
     500, None, "this feed is damaged; the server log names the file and line"),
    (StorageError, 500, "storage failure; nothing was stored",
     500, None, "storage failure; nothing was stored"),
    (SyncError, 500, "internal server error", 500, None, "internal server error"),
)
STORED_NOTHING_ROUTES = ("/v1/push",)  # a StorageError there: nothing was stored (else a read)
CANNOT_READ = ("storage failure: the server cannot read what was asked for; its log names the "
               "file")


def error_response(exc, path=""):
    """The response to any exception, for a request to path: the one place that turns one into a
    response (an exception of no SyncError is an internal error: 500, never its text)."""
    memory_route = path.startswith("/v1/memory/")
    if isinstance(exc, ApiError):
        status, code, text = exc.status, exc.code, exc.text
    else:
        for kind, status, text, memory_status, code, memory_text in ERROR_ANSWERS:
            if isinstance(exc, kind):
                break
        else:
            kind, status, text, memory_status, code, memory_text = ERROR_ANSWERS[-1]
        if memory_route:
            status, text = memory_status, memory_text
        if kind is StorageError and path not in STORED_NOTHING_ROUTES:
            text = CANNOT_READ
        text = text % (exc,) if "%s" in text else text
    body = {}
    if memory_route and code is not None:
        body["code"] = code
    if text:
        body["error"] = text
    headers = [("WWW-Authenticate", "Bearer")] if isinstance(exc, AuthError) else []
    if getattr(exc, "retry_after", None) is not None:
        headers = retry_after(exc.retry_after)
    return json_response(status, body, headers)


class SyncApp:
    """The protocol: routes to thin handlers that parse, call storage and respond."""

    def __init__(self, feeds, memory, auth, config, log, metrics):
        self.feeds = feeds
        self.memory = memory
        self.auth = auth
        self.rate_limiter = RateLimiter(config.memory_rate_limit)
        self.log = log
        self.max_parked = config.max_parked
        self.metrics = metrics
        self.metrics_token = config.metrics_token     # None: no /metrics route
        self.routes = dict(self.ROUTES)
        if self.metrics_token is not None:
            self.routes["/metrics"] = {"GET": "metrics_page"}
        for route, methods in self.routes.items():
            for method in methods:
                self.metrics.expect(route, method)
        self.parked = {}                  # the requests of long-polls waiting now -> FeedWaiter
        self.parked_by = {}               # principal -> the requests of its long-polls parked now
        self._parked_lock = threading.Lock()
        self._watching = False            # whether watch_tokens runs
        self.metrics.gauge("oharness_sync_long_polls_parked", "Long-polls parked now.",
                           lambda: len(self.parked))
        # (principal, body) -> MemoryRequest, for small snapshot bodies
        self._checked_snapshots = {}
        self.log_once = LogOnce(self.log)  # what fails a read

    ROUTES = {
        "/": {"GET": "front_page"},
        "/v1/health": {"GET": "health"},
        "/v1/projects": {"GET": "projects"},
        "/v1/push": {"POST": "push"},
        "/v1/pull": {"GET": "pull"},
        "/v1/memory/identity": {"POST": "memory_identity"},
        "/v1/memory/snapshot": {"POST": "memory_snapshot"},
        "/v1/memory/commit": {"POST": "memory_commit"},
    }

    def handle(self, request):
        """Route a request and turn every expected failure into its response."""
        methods = self.routes.get(request.path)
        if methods is None:
            return json_response(404, {"error": "unknown route"})
        # HEAD: GET less the body
        handler = methods.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            body = {"error": "method not allowed"}
            if request.path.startswith("/v1/memory/"):
                body["code"] = "method_not_allowed"
            allowed = sorted(list(methods) + ["HEAD"] if "GET" in methods else methods)
            return json_response(405, body, [("Allow", ", ".join(allowed))])
        try:
            return getattr(self, handler)(request)
        except ClientGone:
            raise
        except Exception as exc:  # never a stack trace to the client or the log
            return self.failed(request, exc)

    def failed(self, request, exc):
        """The answer to the exception that stopped request (error_response), logged as it needs:
        a refused token's reason kept for the access log, a failed write always, a failed read
        once (it fails again at every poll of every device), anything unexpected by its type."""
        if isinstance(exc, AuthFailure):
            request.refusal = str(exc)  # (the texts never hold a token)
        elif isinstance(exc, StorageError):
            if request.path in STORED_NOTHING_ROUTES:
                self.log("storage failure: %s" % exc)
            else:
                self.log_once("storage failure: %s" % exc)
        elif not isinstance(exc, SyncError):
            self.log("internal error on %s %s: %s: %s" % (
                printable(request.method), printable(request.path), type(exc).__name__, exc))
        return error_response(exc, request.path)

    # -- session sync ------------------------------------------------------

    def session_identity(self, request):
        """The verified Identity of the request's token (a failure is answered by
        ERROR_ANSWERS)."""
        identity = self.auth.identify(request.headers.get("authorization"), request.client)
        request.principal = identity.principal
        return identity

    @staticmethod
    def feed_owner(identity, team):
        """The personal feed without a team; a team's feed only if the token lists it (else
        403)."""
        if team is None:
            return ("u", identity.principal)
        if team not in identity.teams:
            raise Forbidden("this token is not a member of that team")
        return ("t", team)

    def health(self, request):
        return Response(200, b'{"ok":true}')

    def front_page(self, request):
        """A page for a person who types the server's address into a browser: what this is and
        how to point a client at it. Nothing of any tenant, and nothing to run."""
        url = public_url(request.headers, request.tls)
        http_note = ("" if url.startswith("https:") else
                 " OHarness takes plain <code>http://</code> only for localhost: on a network, "
                 "put HTTPS in front of this server and use that address.")
        page = FRONT_PAGE % {"version": __version__, "url": html.escape(url, quote=True),
                             "plain": http_note}
        return Response(200, page.encode("utf-8"), [
            ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"),
            ("X-Content-Type-Options", "nosniff"),
            # The page shows what these headers say: a cache must not hand it to another request.
            ("Cache-Control", "no-cache"),
            ("Vary", "Host, Forwarded, X-Forwarded-Proto, X-Forwarded-Host")],
            content_type="text/html; charset=utf-8")

    def metrics_page(self, request):
        """The server's metrics, in Prometheus' text format, for a scraper with the metrics
        token."""
        token = bearer_token(request.headers.get("authorization"))
        if not hmac.compare_digest(token.encode("utf-8"), self.metrics_token.encode("utf-8")):
            raise AuthError("this is not the metrics token")
        return Response(200, exposition(self.metrics),
                        content_type="text/plain; version=0.0.4; charset=utf-8")

    def projects(self, request):
        identity = self.session_identity(request)
        owner = self.feed_owner(identity, request.param("team"))
        return json_response(200, {"projects": self.feeds.projects(owner)})

    def push(self, request):
        identity = self.session_identity(request)
        body = request.read_body(MAX_PUSH_BYTES)
        if too_many_containers(body, MAX_PUSH_CONTAINERS):  # decoded, each would take memory
            raise TooLarge("more than %d JSON arrays and objects in one push"
                           % MAX_PUSH_CONTAINERS)
        try:
            doc = decode_json(body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        push = validate_push(doc)
        owner = self.feed_owner(identity, push.team)
        cursor, accepted = self.feeds.push(owner, push.project, push.records, push.sessions)
        return Response(200, b'{"cursor":%d,"accepted":%d}' % (cursor, accepted))

    def pull(self, request):
        identity = self.session_identity(request)
        project = request.param("project")
        if not is_valid_id(project):
            raise BadRequest("project must be an id of 1 to 128 characters [A-Za-z0-9_-]")
        owner = self.feed_owner(identity, request.param("team"))
        since = parse_cursor(request.param("since"))
        limit = parse_clamped(request.param("limit"), "limit", 1, MAX_PULL_LIMIT,
                              default=MAX_PULL_LIMIT)
        wait = parse_clamped(request.param("wait"), "wait", 0, MAX_WAIT_SECONDS, default=0)
        page = self.feeds.pull(owner, project, since, limit)
        if page.records or page.sessions or wait == 0:
            return Response(200, page.to_json())

        def answer():  # (maybe in the thread of the push that woke the pull: see park)
            refused = self.refusal_now(request)
            if refused is not None:
                return refused
            return Response(200, self.feeds.pull(owner, project, since, limit).to_json())

        return self.park(request, owner, project, since, seconds=wait, make_response=answer)

    def refusal_now(self, request):
        """The answer refusing the request's token now, or None while it is still good: a parked
        pull's token may have been revoked (or have expired) while it waited, and what was pushed
        since is not for it."""
        try:
            self.session_identity(request)
        except AuthFailure as exc:
            return self.failed(request, exc)
        return None

    def park(self, request, owner, project, since, seconds, make_response):
        """Hold a pull until its feed has an event after since, its wait is over, the server stops,
        or its client closes its side (looked at every PARKED_CHECK_SECONDS, so an abandoned pull
        gives its place back soon; one that only half-closed still reads its response); then
        make_response(). Past max_parked, or past half of it for the request's principal (so that
        one principal's devices cannot take every place): make_response() at once. A pull whose
        token watch_tokens finds refused is woken too (its request.refusal set).

        The thread that wakes the pull sends its response (on_event, see wake_waiters); Feed.read
        builds one Page for all the pulls a push wakes. It gives the pull's place back first: a
        client that has its answer and pulls again on a new connection finds its place free."""
        principal, handler = request.principal, request.handler

        def on_event():  # in the thread that wakes the pull
            self._unpark(request, principal, mine)
            handler.respond_early(request, make_response)

        waiter = FeedWaiter(on_event)
        with self._parked_lock:  # (the counts and the adds, together)
            if (len(self.parked) >= self.max_parked
                    or len(self.parked_by.get(principal, ())) >= max(1, self.max_parked // 2)):
                return make_response()
            mine = self.parked_by.setdefault(principal, set())
            self.parked[request] = waiter
            mine.add(request)
            watch, self._watching = not self._watching, True
        handler.hold(request)
        try:
            if watch:
                self.start_watching()
            deadline = time.monotonic() + seconds
            while True:
                left = deadline - time.monotonic()
                # Held from the look at request.refusal into the wait: watch_tokens sets it under
                # the same lock, so its wake cannot come between the two and be lost.
                with waiter.woken:
                    if (left <= 0 or request.refusal is not None
                            or self.feeds.wait(owner, project, since, waiter=waiter,
                                               timeout=min(left, PARKED_CHECK_SECONDS))):
                        break
                if handler.client_gone():
                    break
        finally:
            self._unpark(request, principal, mine)
            early = handler.release()
        return early if early is not None else make_response()

    def _unpark(self, request, principal, mine):
        """Give a parked pull's place back (again: a no-op). mine: its principal's parked pulls."""
        # No lock: the pulls one push woke would all queue for it; only a principal's last pull
        # takes it, to forget the principal.
        self.parked.pop(request, None)
        mine.discard(request)
        if not mine:
            with self._parked_lock:
                if not mine and self.parked_by.get(principal) is mine:
                    del self.parked_by[principal]

    def start_watching(self):
        """Start watch_tokens in a thread of its own."""
        try:
            threading.Thread(target=self.watch_tokens, name="parked-tokens", daemon=True).start()
        except RuntimeError as exc:  # no thread to spare: a pull's answer still checks its token
            self.log("cannot watch the parked pulls' tokens: %s" % exc)
            with self._parked_lock:
                self._watching = False

    def watch_tokens(self):
        """While pulls are parked: look at the token file every TOKEN_RELOAD_SECONDS, and check
        again the token of each pull parked since the last look, or of every parked pull when the
        tokens in force changed; wake one that is refused now, to answer its refusal. So a revoked
        token's long-poll answers 401 within a second or two of the revoke, as its other requests
        do. Ends when no pull is parked."""
        local = self.auth.local
        generation, checked = local.generation, set()
        try:
            while True:
                time.sleep(TOKEN_RELOAD_SECONDS)
                with self._parked_lock:
                    if not self.parked:
                        self._watching = False
                        return
                    held = list(self.parked.items())
                local.refresh()
                if local.generation != generation:
                    generation, checked = local.generation, set()
                for request, waiter in held:
                    if request not in checked:
                        self._check_parked(request, waiter)
                checked = {request for request, _ in held}
        except Exception as exc:  # (the next pull to park starts it again)
            self.log("checking parked pulls' tokens: %s: %s" % (type(exc).__name__, exc))
            with self._parked_lock:
                self._watching = False

    def _check_parked(self, request, waiter):
        """Wake a parked pull whose token is refused now (one that cannot be checked now waits
        on: its answer checks it again)."""
        try:
            self.auth.identify(request.headers.get("authorization"), request.client)
        except (AuthError, NotListed) as exc:
            with waiter.woken:
                request.refusal = str(exc)
                waiter.woken.notify()
        except (AuthThrottled, AuthUnavailable):
            pass

    # -- memory sync -------------------------------------------------------

    def memory_identity(self, request):
        principal, _ = self.memory_request(request, "identity")
        return json_response(200, {"principal": principal, "quota": self.memory.quota_doc()})

    def memory_snapshot(self, request):
        principal, req = self.memory_request(request, "snapshot")
        return Response(200, self.memory.snapshot(principal, req.scope, req.known_etag,
                                                  req.have).to_json())

    def memory_commit(self, request):
        principal, req = self.memory_request(request, "commit")
        return Response(200, self.memory.commit(principal, req.scope, req.etag, req.changes,
                                                have=req.have).to_json())

    def memory_request(self, request, kind):
        """The contract's checks, in its order; (verified principal, MemoryRequest)."""
        if request.headers.get("origin") is not None:
            raise Forbidden("memory sync is for native clients only", "native_client_required")
        content_type = request.headers.get("content-type")
        if content_type != "application/json" and (
                content_type or "").split(";", 1)[0].strip().lower() != "application/json":
            raise UnsupportedType("Content-Type must be application/json", "json_required")
        identity = self.auth.identify_for_memory(request.headers.get("authorization"),
                                                 request.client)
        request.principal = identity.principal
        body = request.read_body(MAX_MEMORY_BODY)
        # A client polling for changes sends the same small snapshot body again and again: its
        # checked fields are remembered (they depend on nothing but the body and the principal at
        # that size).
        remembered = kind == "snapshot" and len(body) <= REMEMBERED_BODY_BYTES
        fields = self._checked_snapshots.get((identity.principal, body)) if remembered else None
        if fields is None:
            try:
                doc = decode_json(body)
            except ValueError as exc:
                raise BadRequest(str(exc), "invalid_body") from None
            check_memory_envelope(kind, doc, identity.principal)
        wait = self.rate_limiter.retry_after(identity.principal)
        if wait:
            raise RateLimited("too many memory requests", "rate_limited", retry_after=wait)
        if fields is None:
            fields = memory_fields(kind, doc, self.memory.quota)
            if remembered:
                if len(self._checked_snapshots) >= REMEMBERED_BODIES:
                    self._checked_snapshots.clear()
                self._checked_snapshots[(identity.principal, body)] = fields
        return identity.principal, fields


# ---- the request head and body, read strictly ----------------------------------
#
# The handler reads each head once, line by line, and checks each line as it comes: RFC 9112's
# rules for an exposed server (a cap on the whole head and on its fields, CRLF line ends, SP
# between the request line's parts, a token and a colon to begin a field, SP and HTAB as the only
# whitespace, no control byte), then one framing of a body. http.server's own, lenient reading
# (through the email package) is never used: it was half the CPU of a small request.

_REASONS = {status: phrase.encode("latin-1")
            for status, (phrase, _) in http.server.BaseHTTPRequestHandler.responses.items()}
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(r"(" + _TOKEN + r") ([\x21-\x7e]+) (HTTP/[0-9]\.[0-9])\r\n")
# A field's value may hold no control byte but HTAB; its SP and HTAB around are trimmed afterwards
# (in the pattern, an optional run of them before a value that may hold them too backtracks in
# quadratic time on a long line of blanks).
_FIELD_LINE = re.compile(r"(" + _TOKEN + r"):([\t\x20-\x7e\x80-\xff]*)\r\n")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,8})(;[\t\x20-\x7e\x80-\xff]*)?\r\n")
_QUERY = re.compile(r"\?.*?(?= HTTP/[0-9]\.[0-9]$|$)")  # to the version, spaces and all
LATE_REQUEST_NOTE = "closed a connection whose request did not arrive in time"
HEAD_TOO_LARGE = "request head larger than %d bytes or with more than %d header fields" % (
    MAX_HEAD_BYTES, MAX_HEADERS - 1)


def read_fields(rfile, left, fields, known=None):
    """Read header (or trailer) fields from rfile up to their blank line, into fields: a dict by
    lower-case name, a repeated field's values joined with ", ", each value trimmed of SP and HTAB
    only (str.strip() would also take VT, FF, NBSP and more as whitespace). At most MAX_HEADERS - 1
    fields and left bytes, the blank line included.

        Host: x  /  X-Tag: a  /  x-tag:\tb\x20   {"host": "x", "x-tag": "a, b"}
        X-Empty:                                 {"x-empty": ""}
        (over left bytes, or 100 fields)         HeadTooLarge (431)
        Name : x  /  \x20Folded: x  /  X: a\x00b  HeadRefused (400), as is a bare CR or LF
        (the connection ends first)              ClientGone

    Returns {line: (name, value)} of the lines read. Given as known for the next head of the same
    connection, a line that comes again (a keep-alive client sends its Host, Authorization and the
    like with every request) is taken as it was parsed, unchecked: the same bytes pass the same
    way.
    """
    lines = {}
    for _ in range(MAX_HEADERS):
        line = rfile.readline(left + 1)
        if len(line) > left:
            raise HeadTooLarge(HEAD_TOO_LARGE)
        if line == b"\r\n":
            return lines
        left -= len(line)
        field = known.get(line) if known else None
        if field is None:
            match = _FIELD_LINE.fullmatch(line.decode("latin-1"))
            if match is None:
                if not line.endswith(b"\n"):
                    raise ClientGone()
                raise HeadRefused("malformed header line")
            name, value = match.groups()
            field = name.lower(), value.strip(" \t")
        lines[line] = field
        name, value = field
        fields[name] = fields[name] + ", " + value if name in fields else value
    raise HeadTooLarge(HEAD_TOO_LARGE)


def connection_tokens(headers):
    value = headers.get("connection")
    return {token.strip(" \t").lower() for token in value.split(",")} if value else set()


def declares_body(headers):
    if headers.get("transfer-encoding") is not None:
        return True
    length = headers.get("content-length")
    return length is not None and length != "0"


def body_length(headers, limit):
    """The Content-Length of a body of at most limit bytes, or None for a chunked body; BadRequest
    or TooLarge for a bad or oversized one (before any of it is read)."""
    encoding = headers.get("transfer-encoding")
    length = headers.get("content-length")
    if encoding is not None:
        if encoding.lower() != "chunked" or length is not None:
            raise BadRequest("unsupported Transfer-Encoding")
        return None
    if not (length.isascii() and length.isdigit()):
        raise BadRequest("bad Content-Length")
    length = length.lstrip("0") or "0"  # int() refuses strings of over 4,300 digits, zeros too
    if len(length) > 16 or int(length) > limit:
        raise TooLarge("request body is larger than %d bytes" % limit)
    return int(length)


def read_chunked(rfile, limit):
    """A chunked body from rfile, of at most limit bytes; its trailer fields are read as header
    fields are (read_fields), and dropped. ClientGone when the connection ends first; BadRequest
    for a bad chunk size, a chunk not followed by CRLF or a bad trailer field, TooLarge for an
    oversized body."""
    chunks, total = [], 0
    while True:
        line = rfile.readline(1024)
        if not line.endswith(b"\n"):
            raise ClientGone()
        match = _CHUNK_LINE.fullmatch(line)
        if match is None:
            raise BadRequest("bad chunk size")
        size = int(match.group(1), 16)
        if size == 0:
            break
        total += size
        if total > limit:
            raise TooLarge("request body is larger than %d bytes" % limit)
        chunk, end = rfile.read(size), rfile.read(2)
        if len(chunk) < size or len(end) < 2:
            raise ClientGone()
        if end != b"\r\n":
            raise BadRequest("a chunk not followed by CRLF")
        chunks.append(chunk)
    try:
        read_fields(rfile, MAX_HEAD_BYTES, {})
    except HeadRefused as exc:  # (a bare LF must not end the body: it would swallow what follows)
        raise BadRequest("trailer fields over %d bytes or %d fields"
                         % (MAX_HEAD_BYTES, MAX_HEADERS - 1) if isinstance(exc, HeadTooLarge)
                         else "malformed trailer field") from None
    return b"".join(chunks)


def render(response, method, close, no_store):
    """The bytes of a response: status line, headers, body (none for HEAD), in one piece for one
    send. no_store: `Cache-Control: no-store` in place of the route's own (see
    SyncRequestHandler.response_bytes)."""
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        response.status, _REASONS.get(response.status, b"Unknown"),
        response.content_type.encode("latin-1"), len(response.body))
    if response.headers:
        head += "".join("%s: %s\r\n" % header for header in response.headers
                        if not (no_store and header[0] == "Cache-Control")).encode("latin-1")
    if no_store:
        head += b"Cache-Control: no-store\r\n"
    head += b"Connection: close\r\n\r\n" if close else b"\r\n"
    return head if method == "HEAD" else head + response.body


def printable(text):
    """text with every character outside printable ASCII escaped, for a log line."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(c if " " <= c <= "~"
                   else "\\x%02x" % ord(c) if ord(c) < 256
                   else "\\u%04x" % ord(c)
                   for c in text)


# ---- the transport ------------------------------------------------------------

class Watchdog:
    """Keeps every connection's time limit: a request that has not fully arrived in time (logged),
    a connection idle or stuck sending for too long (quietly), a refused one's linger (closed).

    Sockets are blocking with no timeout of their own: a per-receive timeout cannot bound a whole
    request (one byte a second never trips it). One thread looks at the deadlines four times a
    second and shuts a late socket down, which ends whatever receive or send waits on it.
    """

    def __init__(self, log):
        self.log = log
        # socket -> (deadline, what to log or None, close it)
        self._deadlines = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def arm(self, sock, seconds, late_note=None, close=False):
        """Shut sock down (close=True: close it) unless armed again or disarmed within seconds."""
        with self._lock:
            self._deadlines[sock] = (time.monotonic() + seconds, late_note, close)

    def disarm(self, sock):
        with self._lock:
            self._deadlines.pop(sock, None)

    def _run(self):
        while not self._stopped.wait(SWEEP_SECONDS):
            try:
                self.end_late(time.monotonic())
            except Exception as exc:  # it must live on: without it no connection has a time limit
                self.log("watchdog: %s: %s" % (type(exc).__name__, exc))

    def end_late(self, now, quiet=False):
        """One sweep: end every socket late at now (quiet: without logging its note)."""
        # Ended under the lock (neither waits): a socket armed again or disarmed a moment ago is
        # not late.
        with self._lock:
            late = [(sock, entry) for sock, entry in self._deadlines.items() if entry[0] <= now]
            for sock, (_, _, close) in late:
                del self._deadlines[sock]
                if close:
                    sock.close()
                else:
                    shut_down(sock)
        for _, (_, note, _) in late:
            if note and not quiet:
                self.log(note)

    def stop(self):
        """Stop watching; the sockets still watched are ended now."""
        self._stopped.set()
        self.end_late(float("inf"), quiet=True)


def shut_down(sock):
    """Shut a connection down, which ends any receive or send waiting on it. The plain socket's
    shutdown, also under TLS: the SSL object stays as it is for the thread reading or writing
    through it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class SyncRequestHandler(http.server.BaseHTTPRequestHandler):
    """One connection's thread: read a request, hand it to the app, send the response, again.

    http.server reads the request line and headers (parse_request); every method then reaches the
    app (an unknown one is a 405, never http.server's 501), and each response leaves in one send
    with TCP_NODELAY set.
    """

    protocol_version = "HTTP/1.1"
    server_version = "oharness-sync/" + __version__
    disable_nagle_algorithm = True
    # The flag of a send or a peek that does not wait; None where there is none (Windows): then no
    # early answer and no look for a parked pull's client.
    dont_wait = getattr(socket, "MSG_DONTWAIT", None)

    def setup(self):
        super().setup()
        # Blocking, without a timeout: every time limit is the watchdog's (after a TLS handshake,
        # which had one of its own). Until the first request, the idle limit holds.
        self.connection.settimeout(None)
        self.server.opened(self.connection)
        self.body_pending = False   # a declared body not read: answering it closes the connection
        self.held = None            # the parked pull waiting now: another thread may answer it
        self.early = None           # (response, what is left to send) once another thread sent it
        self.early_lock = threading.Lock()
        self.known_lines = None     # the last head's field lines, as parsed (read_fields)
        self.tally = self.server.metrics.open_tally() if self.server.counting else None
        # A trusted proxy's requests name their client (forwarded_client); anyone else's do not.
        self.via_proxy = self.server.trusts(self.client_address[0])
        self.server.watchdog.arm(self.connection, self.server.idle_seconds)

    def finish(self):
        if self.tally is not None:
            self.server.metrics.close_tally(self.tally)
        try:
            super().finish()
            if self.body_pending:
                self.linger()
        finally:
            self.server.watchdog.disarm(self.connection)
            self.server.closed(self.connection)

    def handle_one_request(self):
        try:
            # waits for a request to begin (the idle limit holds meanwhile)
            arrived = self.rfile.peek(1)
            # RFC 9112 2.2: one empty line before a request is ignored (e.g. a CRLF sent after a
            # body); its request still waits idle
            if arrived[:1] in (b"\r", b"\n"):
                for empty in (b"\r\n", b"\n"):
                    if arrived.startswith(empty):
                        self.rfile.read(len(empty))
                        arrived = self.rfile.peek(1)
                        break
            if not arrived:
                self.close_connection = True
                return
        except OSError:
            self.close_connection = True
            return
        self.server.watchdog.arm(self.connection, self.server.request_seconds, LATE_REQUEST_NOTE)
        try:
            if self.parse_request():
                self.handle_request()
        except (ClientGone, OSError):  # the client left, or was cut off by the watchdog
            self.close_connection = True

    # -- the request head ----------------------------------------------------

    def parse_request(self):
        """Read the head of the next request once, strictly: command, path and request_version from
        its request line, headers (a dict by lower-case name, read_fields) and whether the
        connection stays open after the response. False when the head was refused, and answered
        (refuse_head):

            a request line over MAX_HEAD_BYTES                       414
            the whole head over MAX_HEAD_BYTES, or over 99 fields    431
            not METHOD SP TARGET SP HTTP/d.d CRLF                    400 bad request line
            a version other than HTTP/1.0 and HTTP/1.1               505
            a field line that is not TOKEN ":" VALUE CRLF            400 malformed header line

        ClientGone when the connection ends inside the head."""
        self.command, self.request_version, self.raw_requestline = None, "HTTP/1.1", b""
        line = self.rfile.readline(MAX_HEAD_BYTES + 1)
        if len(line) > MAX_HEAD_BYTES:
            self.raw_requestline = line[:200]  # (for the log line)
            return self.refuse_head(UriTooLong("request line too long"))
        self.raw_requestline = line
        match = _REQUEST_LINE.fullmatch(line.decode("latin-1"))
        if match is None:
            if not line.endswith(b"\n"):
                raise ClientGone()
            return self.refuse_head(HeadRefused("bad request line"))
        self.command, self.path, self.request_version = match.groups()
        if self.request_version not in ("HTTP/1.1", "HTTP/1.0"):
            return self.refuse_head(VersionRefused("HTTP/1.1 only"))
        # as http.server does: a base URL that ends in "/" still works
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")
        self.headers = headers = {}
        try:
            self.known_lines = read_fields(self.rfile, MAX_HEAD_BYTES - len(line), headers,
                                           self.known_lines)
        except HeadRefused as exc:
            return self.refuse_head(exc)
        tokens = connection_tokens(headers) if "connection" in headers else ()
        if self.request_version == "HTTP/1.0":
            # RFC 9112 6.1: a chunked body from an HTTP/1.0 client leaves its framing in doubt.
            self.close_connection = "keep-alive" not in tokens or "transfer-encoding" in headers
        else:
            self.close_connection = "close" in tokens
        return True

    def refuse_head(self, exc):
        """Answer a refused head (a HeadRefused) and return False; logged once, escaped, without
        the query; the connection then closes."""
        line = str(self.raw_requestline[:200], "latin-1").rstrip("\r\n")
        # a query may hold what is not for a log
        self.server.log("refused a malformed request (%d %s): %s" % (
            exc.status, exc.text, printable(_QUERY.sub("", line, 1))))
        # what follows a refused head is not read: close after the response
        self.body_pending = True
        if self.tally is not None:
            self.tally.count("other", self.command, exc.status, 0.0)
        response = error_response(exc)
        response.close = True
        self.write_response(response, self.command)
        return False

    def log_message(self, format, *args):
        pass  # the server writes its own access log

    # -- the request ---------------------------------------------------------

    def handle_request(self):
        started = time.monotonic()
        headers = self.headers
        path, _, query = self.path.partition("?")
        query = urllib.parse.parse_qs(query, keep_blank_values=True) if query else {}
        self.body_pending = declares_body(headers)
        if not self.body_pending:
            self.server.watchdog.disarm(self.connection)
        client = self.client_address[0]
        if self.via_proxy:
            client = forwarded_client(headers) or client
        request = Request(self, path, query, client)
        self.body = None
        self.server.begin_request(self)
        try:
            response = self.server.app.handle(request)
            self.server.log_access(request, response.status, started)
            if self.tally is not None:
                self.tally.count(path, self.command, response.status, time.monotonic() - started)
            self.write_response(response, self.command)
        finally:
            self.server.end_request(self)

    def read_body(self, limit):
        """The request body, at most limit bytes; BadRequest or TooLarge for a bad or oversized
        one. ClientGone when the client leaves or breaks its framing."""
        if self.body is not None or not self.body_pending:
            return self.body or b""
        headers = self.headers
        length = body_length(headers, limit)
        try:
            if (self.request_version == "HTTP/1.1"
                    and headers.get("expect", "").lower() == "100-continue"):
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits a second otherwise
            if length is None:
                body = read_chunked(self.rfile, limit)
            else:
                body = self.rfile.read(length)
                if len(body) < length:
                    raise ClientGone()
        except OSError:  # reset, or cut off by the watchdog (under TLS an SSLError)
            raise ClientGone() from None
        self.body, self.body_pending = body, False
        self.server.watchdog.disarm(self.connection)
        return body

    def hold(self, request):
        """The request will wait (a parked pull): from now on its wait bounds it, not the request
        deadline (a body it declared stays unread: the response then closes the connection); until
        release(), another thread may answer it (respond_early)."""
        self.server.watchdog.disarm(self.connection)
        with self.early_lock:
            self.held = request

    def respond_early(self, request, make_response):
        """From the thread that woke a parked pull: if request is still held, send make_response()
        now, as much as the socket takes without a wait; this connection's thread sends the rest
        (write_response). A wake that comes late, after the connection moved on to its next
        request, sends nothing. Not under TLS: its records are not for two threads to write; there
        the connection's own thread answers."""
        with self.early_lock:
            if self.held is not request or self.server.tls is not None or self.dont_wait is None:
                return
            response = make_response()
            self.held = None
            data = self.response_bytes(response, self.command)
            try:
                sent = socket.socket.send(self.connection, data, self.dont_wait)
            except OSError:  # the send buffer is full (or the client left): all for write_response
                sent = 0
            self.early = (response, data[sent:])

    def release(self):
        """The wait is over: no other thread answers the request now. The response one sent, or
        None."""
        with self.early_lock:
            self.held = None
            return self.early[0] if self.early is not None else None

    def client_gone(self):
        """True when the client has closed its side or reset the connection. Asked while a pull is
        parked: what it may have pipelined meanwhile stays unread. (Under TLS a closing client's
        last record is data to this look, so there it waits out the pull.)"""
        if self.dont_wait is None:
            return False  # (no such look here: the pull waits out its time)
        try:
            return not socket.socket.recv(self.connection, 1, socket.MSG_PEEK | self.dont_wait)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    # -- the response --------------------------------------------------------

    def write_response(self, response, method):
        """Write the response with one send (or what respond_early left of it)."""
        if self.early is not None:
            data, self.early = self.early[1], None
        else:
            data = self.response_bytes(response, method)
        # a client that does not read
        self.server.watchdog.arm(self.connection, self.server.idle_seconds)
        if data:
            self.wfile.write(data)

    def response_bytes(self, response, method):
        """The response's bytes; whether the connection closes after it is decided here, and
        whether a cache may keep it: never an answer to a request with a token (a proxy's cache
        would hand one person's feed to another) nor an error."""
        close = (response.close or self.close_connection or self.body_pending
                 or self.server.stopping.is_set())
        self.close_connection = close
        return render(response, method, close,
                      no_store=response.status >= 400 or "authorization" in self.headers)

    def linger(self):
        """After a last response sent before its request's body was read (an early 401 or 413):
        send nothing more and drop what still arrives, until the client closes or LINGER_SECONDS
        pass. Closing on unread bytes would reset the connection, and the response with it."""
        # (one small buffer: nothing new per receive)
        sock, dropped = self.connection, bytearray(4096)
        try:
            socket.socket.shutdown(sock, socket.SHUT_WR)
            self.server.watchdog.arm(sock, LINGER_SECONDS)
            while sock.recv_into(dropped):
                pass
        except OSError:
            pass


class TlsFiles:
    """A certificate and key for HTTPS, re-read on demand (SIGHUP) for renewed certificates."""

    def __init__(self, cert_path, key_path):
        self.cert_path = cert_path
        self.key_path = key_path
        self.context = self.load()

    def load(self):
        """A server context for the files: TLS 1.2 or newer. ssl.SSLError or OSError when
        unusable."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_path, self.key_path)
        return context



def cap_refusal(text):
    """The bytes of the 503 (Busy) that the accepting thread sends a connection past a cap."""
    return render(error_response(Busy(text, retry_after=1)), "GET", close=True, no_store=True)


_REFUSAL = cap_refusal("server is at its connection limit; try again shortly")
_ADDRESS_REFUSAL = cap_refusal("too many connections from this address; try again shortly")


class SyncServer(http.server.ThreadingHTTPServer):
    """http.server's ThreadingHTTPServer, with a connection cap, TLS, a watchdog and a quiet error
    path.

    Past max_connections, or past max_per_address from one client (client_key: IPv6 by its /64),
    a new connection gets a 503 at once, from the accepting thread: never more threads than that,
    and one address cannot take every place. A trusted proxy's connections (trusted_proxies:
    ipaddress networks) carry many clients: they are not counted per address, and their requests'
    client is the one the proxy names (forwarded_client). With TLS, the handshake runs in the
    connection's own thread.
    """

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, app, config, log, listener=None):
        if ":" in config.host:
            self.address_family = socket.AF_INET6
        self.app = app
        self.config = config                   # what reload_files re-reads
        self.tls = config.tls                  # a TlsFiles, or None for plain HTTP
        self.request_seconds = config.request_seconds
        self.idle_seconds = config.idle_seconds
        self.max_connections = config.max_connections
        self.max_per_address = (max(1, config.max_connections // PER_ADDRESS_SHARE)
                                if config.max_per_address is None else config.max_per_address)
        self.trusted_proxies = tuple(config.trusted_proxies)
        self.log = log
        # --quiet: no line is even formatted
        self.access_log = None if getattr(log, "quiet", False) else log.access
        self.stopping = threading.Event()      # set: responses close their connections
        self.connections = 0                   # accepted, not yet closed (past the cap: refused)
        self._per_address = {}                 # client_key -> its connections, while it has one
        # handlers answering a request (set.add and discard need no lock)
        self._in_flight = set()
        self._open = set()                     # the sockets of connections being served
        self._lock = threading.Lock()
        self._plain_http_logged = False        # (plain_http_came)
        self.metrics = app.metrics
        self.counting = app.metrics_token is not None  # each connection counts its requests
        self.metrics.gauge("oharness_sync_connections_open", "Connections open now.",
                           lambda: self.connections)
        self.watchdog = Watchdog(self.log)     # before binding: a failed bind calls server_close
        self.listener = listener               # bound already (bind_listener), or None
        super().__init__((config.host, config.port), SyncRequestHandler)

    def server_bind(self):
        if self.listener is None:
            super().server_bind()
            return
        self.socket.close()  # socketserver's own, unbound: the listener serves instead
        self.socket = self.listener
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = self.server_address[:2]

    @property
    def url(self):
        host, port = self.server_address[:2]
        scheme = "https" if self.tls else "http"
        return "%s://%s:%d" % (scheme, "[%s]" % host if ":" in host else host, port)

    # -- connections ---------------------------------------------------------

    def trusts(self, address):
        """Whether a peer address is one of the trusted proxies."""
        if not self.trusted_proxies:
            return False
        ip = ip_address(address)
        return ip is not None and any(ip in network for network in self.trusted_proxies)

    def counted_as(self, address):
        """What a peer's connections are counted under for max_per_address; None: not counted (a
        trusted proxy)."""
        return None if self.trusts(address) else client_key(address)

    def process_request(self, request, client_address):
        key = self.counted_as(client_address[0])
        with self._lock:
            if self.connections >= self.max_connections:
                refused = _REFUSAL
            elif key is not None and self._per_address.get(key, 0) >= self.max_per_address:
                refused = _ADDRESS_REFUSAL
            else:
                refused = None
                self.connections += 1
                if key is not None:
                    self._per_address[key] = self._per_address.get(key, 0) + 1
        if refused is not None:
            return self.turn_away(request, refused)
        try:
            super().process_request(request, client_address)  # a thread for the connection
        except BaseException:
            self.connection_over(key)
            raise

    def process_request_thread(self, request, client_address):
        try:
            if self.tls is not None:
                request = self.handshake(request)
            if request is not None:
                super().process_request_thread(request, client_address)
        finally:
            self.connection_over(self.counted_as(client_address[0]))

    def connection_over(self, key):
        """A connection counted under key (None: per address not at all) is closed."""
        with self._lock:
            self.connections -= 1
            if key is not None:
                left = self._per_address.pop(key) - 1
                if left:
                    self._per_address[key] = left

    def handshake(self, sock):
        """The TLS handshake, in the connection's own thread and within the request time limit: a
        client that stalls it, or speaks plain HTTP, costs only its own thread. None when it
        fails."""
        try:
            tls_sock = self.tls.context.wrap_socket(sock, server_side=True,
                                                    do_handshake_on_connect=False)
        except (OSError, ValueError):
            sock.close()
            return None
        self.watchdog.arm(tls_sock, self.request_seconds, LATE_REQUEST_NOTE)
        try:
            tls_sock.do_handshake()
            return tls_sock
        except (OSError, ValueError) as exc:
            if getattr(exc, "reason", None) == "HTTP_REQUEST":
                self.plain_http_came(tls_sock)
            tls_sock.close()
            return None
        finally:
            self.watchdog.disarm(tls_sock)

    def plain_http_came(self, sock):
        """Log, the first time only in a run, that a client sent plain HTTP to this TLS port: an
        owner's http:// typo, which the client sees only as a closed connection."""
        with self._lock:
            if self._plain_http_logged:
                return
            self._plain_http_logged = True
        try:
            address = sock.getpeername()[0]
        except OSError:  # gone already
            address = "an address gone since"
        self.log("a client spoke plain HTTP to this TLS port (%s): it needs https://; said once "
                 "a run, others are not logged" % address)

    def turn_away(self, sock, answer):
        """Past a connection cap: a 503 JSON response (answer, its bytes) rather than a hang (with
        TLS: closed at once). The socket is closed LINGER_SECONDS later, so closing does not reset
        the response away."""
        self.metrics.add("refused")
        try:
            if self.tls is None:
                sock.setblocking(False)
                sock.send(answer)
                sock.shutdown(socket.SHUT_WR)
                self.watchdog.arm(sock, LINGER_SECONDS, close=True)
                return
        except OSError:
            pass
        sock.close()

    def opened(self, sock):
        with self._lock:
            self._open.add(sock)

    def closed(self, sock):
        with self._lock:
            self._open.discard(sock)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, socket.timeout)):
            self.log("connection error: %s: %s" % (type(exc).__name__, exc))

    # -- requests ------------------------------------------------------------

    @property
    def busy(self):
        """Requests being answered, for a graceful stop."""
        return len(self._in_flight)

    def begin_request(self, handler):
        self._in_flight.add(handler)

    def end_request(self, handler):
        self._in_flight.discard(handler)

    def log_access(self, request, status, started):
        """One line of the access log: client address, method, path (no query), status,
        milliseconds, principal, and for a refused token why (never the token)."""
        if self.access_log is not None:
            self.access_log("%s %s %s %d %.1fms %s%s" % (
                request.client, printable(request.method), printable(request.path), status,
                (time.monotonic() - started) * 1000, request.principal or "-",
                "" if request.refusal is None else " (%s)" % request.refusal))

    # -- stopping ------------------------------------------------------------

    def stop(self, grace):
        """Stop gracefully, from another thread than serve_forever's (while it runs): accept no new
        connection, answer parked long-polls at once, give the requests being answered up to grace
        seconds (in-flight pushes finish), then end every connection."""
        self.stopping.set()                    # responses close their connections
        try:  # ends serve_forever's wait for a connection at once (Linux), not at its next look
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.shutdown()                        # serve_forever returns: no new connection
        self.socket.close()
        self.app.feeds.stop()
        self.wait_idle(grace)
        self.server_close()

    def wait_idle(self, seconds):
        """Wait until no request is being answered (in-flight pushes finish before exit); True if
        none is. (It looks every 20 ms rather than being told: it runs once, at shutdown.)"""
        deadline = time.monotonic() + seconds
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.busy == 0

    def server_close(self):
        """Close the listening socket and end every connection: none outlives the server."""
        super().server_close()
        self.watchdog.stop()
        with self._lock:
            open_sockets = list(self._open)
        for sock in open_sockets:
            shut_down(sock)


# -------------------------------------------------------------------------------------------------
# Serving: the command line that runs the server, and its signals
# -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ServerConfig:
    """What the serving flags decide, read and checked by config_from_flags, and passed whole to
    build_server; each default is its flag's."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # None: a PER_ADDRESS_SHARE-th of max_connections
    max_per_address: typing.Optional[int] = None
    trusted_proxies: tuple = ()            # ipaddress networks (trusted_proxy)
    max_parked: int = DEFAULT_MAX_PARKED
    request_seconds: float = DEFAULT_REQUEST_SECONDS
    idle_seconds: float = IDLE_SECONDS
    retain_deleted_days: int = DEFAULT_RETAIN_DELETED_DAYS
    metrics_token: typing.Optional[str] = None          # None: no /metrics route
    metrics_token_file: typing.Optional[str] = None     # re-read on SIGHUP
    principals: typing.Optional["PrincipalList"] = None  # None: everyone with a token
    reserve_disk: typing.Optional[int] = None  # bytes; None: default_reserve of the data dir
    tls: typing.Optional["TlsFiles"] = None    # None: plain HTTP
    jwt: typing.Optional["JwtVerifier"] = None
    memory_mode: str = "local"
    supabase: typing.Optional["SupabaseVerifier"] = None
    memory_rate_limit: int = DEFAULT_MEMORY_RATE_LIMIT


class Log:
    """Lines on stderr: events always, the access log unless --quiet. Never a token."""

    def __init__(self, stream=None, quiet=False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self._lock = threading.Lock()

    def __call__(self, message):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self._lock:
            try:
                self.stream.write("%s %s\n" % (stamp, message))
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def access(self, line):
        if not self.quiet:
            self(line)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2, through UsageError."""

    def error(self, message):
        raise UsageError(message)


def bind_listener(host, port):
    """A socket listening on host:port, for build_server: bound before root works as the data
    dir's owner (act_as_data_dir_owner), so that a port below 1024 (443) needs no proxy. OSError
    when it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def build_server(data_dir, config, log, listener=None):
    """A ready, bound SyncServer for data_dir as config (a ServerConfig) says (the data-dir lock is
    the caller's business): on listener (bind_listener), else on config's host and port. With a
    metrics_token, GET /metrics answers whoever has it; with principals (a PrincipalList), only
    those it lists are served; writes leave reserve_disk bytes of the disk free."""
    metrics = Metrics()
    reserve_disk = (default_reserve(data_dir) if config.reserve_disk is None
                    else config.reserve_disk)
    auth = Authenticator(LocalTokenVerifier(TokenStore(data_dir), log), config, metrics)
    feeds = FeedStore(data_dir, log, metrics)
    memory = MemoryStore(data_dir, log, metrics)
    try:  # before the server is bound: no request is served from the copy as it was
        apply_restore(feeds, memory, log)
    except FeedDamaged as exc:
        raise UsageError("cannot start on the restored copy %s: a damaged feed: %s; fsck --data "
                         "%s --repair mends it" % (data_dir, exc, data_dir)) from None
    except (OSError, ValueError, StorageError) as exc:
        what = reason(exc)
        if getattr(exc, "filename", None):
            what = "%s: %s" % (exc.filename, what)
        raise UsageError("cannot start on the restored copy %s: %s" % (data_dir, what)) from None
    feeds.count_bytes()  # one walk of the disk, after the restore's: never at a scrape or a push
    memory.count_bytes()
    disk = DiskReserve(data_dir, reserve_disk, log) if reserve_disk > 0 else None
    if disk is not None and disk_free(data_dir) < reserve_disk:
        log("warning: the disk of %s has %s free, less than --reserve-disk %s: pushes and memory "
            "commits are refused until there is room" % (
                data_dir, format_bytes(disk_free(data_dir)), format_size(reserve_disk)))
    feeds.limits = memory.limits = StorageLimits(metrics, config.principals, disk)
    if config.metrics_token is not None:
        for name, text, read in (
                ("oharness_sync_feed_bytes", "Bytes of the feeds on disk.", feeds.bytes_on_disk),
                ("oharness_sync_memory_bytes", "Bytes of memory sync on disk.",
                 memory.bytes_on_disk),
                ("oharness_sync_disk_free_bytes", "Free bytes on the data dir's disk.",
                 lambda: shutil.disk_usage(data_dir).free),
                ("oharness_sync_disk_reserve_bytes", "Free bytes pushes and memory commits must "
                 "leave on the disk (--reserve-disk; 0: off).", lambda: reserve_disk),
                ("oharness_sync_disk_reserve_reached", "1 while pushes and memory commits are "
                 "refused at the disk's reserve.", disk.is_low if disk else lambda: 0),
                ("oharness_sync_feeds_damaged", "Feeds refused for a damaged line.",
                 feeds.damaged)):
            metrics.gauge(name, text, read)
    app = SyncApp(feeds, memory, auth, config, log=log, metrics=metrics)
    return SyncServer(app, config, log, listener)


def add_auth_flags(parser):
    group = parser.add_argument_group("tokens")
    group.add_argument("--jwt-secret-file", metavar="FILE",
                       help="accept HS256 JWTs signed with this secret")
    keys = group.add_mutually_exclusive_group()
    keys.add_argument("--jwks-url", metavar="URL",
                      help="accept RS256/ES256 JWTs signed by these keys")
    keys.add_argument("--jwks-file", metavar="FILE", help="the same, from a file")
    group.add_argument("--jwt-issuer", metavar="ISS", help="require this iss claim")
    group.add_argument("--jwt-audience", metavar="AUD", help="require this aud claim")
    group.add_argument("--memory-auth", choices=("local", "supabase", "off"), default="local",
                       help="who verifies memory-sync tokens (default: local)")
    group.add_argument("--supabase-url", metavar="URL", help="with --memory-auth supabase")
    group.add_argument("--supabase-anon-key-file", metavar="FILE",
                       help="with --memory-auth supabase")
    group.add_argument("--memory-rate-limit", type=int, default=DEFAULT_MEMORY_RATE_LIMIT,
                       metavar="N",
                       help="memory requests per minute and principal, bursts of N/2 "
                            "(0: no limit)")


def read_token_file(path, flag):
    """The first line of a token file, whitespace stripped; UsageError when unusable."""
    try:
        with open(path, "rb") as f:
            line = f.readline(MAX_TOKEN_LENGTH + 2).decode("utf-8").strip()
    except (OSError, ValueError) as exc:
        raise UsageError("cannot read %s %s: %s" % (flag, path, reason(exc))) from None
    if line[:7].lower() == "bearer ":
        raise UsageError("%s %s starts with \"Bearer \": drop it, the file holds the token alone "
                         "(\"Bearer \" is added when it is sent)" % (flag, path))
    if not _TOKEN_CHARACTERS.fullmatch(line or " "):
        raise UsageError("%s %s does not hold a token (printable ASCII, no spaces, "
                         "on its first line)" % (flag, path))
    return line


def read_metrics_token(path):
    """The metrics token on path's first line; UsageError when unusable or shorter than
    MIN_METRICS_TOKEN_LENGTH (/metrics is on the network: a short token can be guessed)."""
    token = read_token_file(path, "--metrics-token-file")
    if len(token) < MIN_METRICS_TOKEN_LENGTH:
        raise UsageError("the token on --metrics-token-file %s is %s: use one of %d or more, e.g. "
                         "python3 -c \"import secrets; print(secrets.token_urlsafe(32))\""
                         % (path, plural(len(token), "character"), MIN_METRICS_TOKEN_LENGTH))
    return token


def auth_from_flags(args, log):
    """(JwtVerifier or None, SupabaseVerifier or None) from the command line; UsageError when
    unusable. log: where a JWKS that cannot be fetched or re-read is reported."""
    path = None  # the file being read, named if it cannot be used
    try:
        path = args.jwt_secret_file
        secret = read_secret_file(path) if path else None
        path = args.jwks_file
        jwks = JwksSource(log, path=path) if path else None
        path = args.supabase_anon_key_file
        anon_key = read_secret_file(path).decode("utf-8").strip() if path else None
    except (OSError, ValueError) as exc:
        raise UsageError("cannot use %s: %s" % (path, reason(exc))) from None
    if args.jwks_url:
        if not args.jwks_url.startswith(("https://", "http://")):
            raise UsageError("--jwks-url must be an http(s) URL")
        jwks = JwksSource(log, url=args.jwks_url)
    if (args.jwt_issuer or args.jwt_audience) and secret is None and jwks is None:
        raise UsageError("--jwt-issuer and --jwt-audience need --jwt-secret-file, --jwks-url or "
                         "--jwks-file")
    jwt = None
    if secret is not None or jwks is not None:
        jwt = JwtVerifier(secret, jwks, args.jwt_issuer, args.jwt_audience)
    supabase = None
    if args.memory_auth == "supabase":
        if not args.supabase_url or anon_key is None:
            raise UsageError("--memory-auth supabase needs --supabase-url and "
                             "--supabase-anon-key-file")
        supabase = SupabaseVerifier(args.supabase_url, anon_key)
    return jwt, supabase


_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PEM_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----")


def refuse_passphrase():
    """The password callback of load_cert_chain: a key that asks for one is refused, never prompted
    for."""
    raise EncryptedKey()


def check_tls_files(cert_path, key_path):
    """UsageError naming the file and the cause when the certificate and key cannot serve HTTPS:
    run before they are loaded at start and on SIGHUP, so an operator reads what is wrong, not an
    SSL code."""
    for what, path, pem in (("certificate", cert_path, _PEM_CERTIFICATE.search),
                            ("key", key_path, _PEM_PRIVATE_KEY.search)):
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise UsageError("cannot read the TLS %s %s: %s" % (what, path, reason(exc))) from None
        if not pem(data):
            raise UsageError("the TLS %s %s is not PEM (no -----BEGIN %s----- line)" % (
                what, path, "CERTIFICATE" if what == "certificate" else "PRIVATE KEY"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path, password=refuse_passphrase)
    except EncryptedKey:
        raise UsageError("the TLS key %s is encrypted: give the server an unencrypted key that "
                         "only its user can read" % key_path) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise UsageError("the TLS key %s does not match the certificate %s"
                             % (key_path, cert_path)) from None
        raise UsageError("cannot use the TLS certificate %s with the key %s: %s"
                         % (cert_path, key_path, exc)) from None
    except OSError as exc:  # gone since it was read
        raise UsageError("cannot read the TLS certificate %s or key %s: %s"
                         % (cert_path, key_path, reason(exc))) from None


def tls_from_flags(args):
    """TlsFiles for --tls-cert and --tls-key, or None; UsageError when only one is given or they
    are unusable."""
    if not args.tls_cert and not args.tls_key:
        return None
    if not (args.tls_cert and args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    check_tls_files(args.tls_cert, args.tls_key)
    try:
        return TlsFiles(args.tls_cert, args.tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise UsageError("cannot use the TLS certificate or key: %s" % reason(exc)) from None


def raise_open_file_limit():
    """Raise the soft open-file limit to the hard one, so a thousand parked long-polls fit."""
    if resource is None:
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft == resource.RLIM_INFINITY or soft >= target:
            return
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass


def is_loopback(host):
    return host in ("localhost", "::1") or host.startswith("127.")


def open_data_dir(path, log, create=False, write=True, deep=True, tokens=False):
    """(absolute path, the directories made for it, outermost first) of a data dir this command
    may use, worked on as its owner when root runs it (act_as_data_dir_owner, which says so to
    log); UsageError, worded alike for every command, when it cannot be used. A data dir is an
    existing directory: only the server and `token issue` (create) make a missing one, so a
    mistyped --data is made by no other command; they also make and remove a file in it (a
    read-only file system, an ACL: what modes do not show), as they write at once. write: the
    command may change the dir, else it only reads it; deep: every file's mode is checked, not
    only the top's (check_data_dir_access); tokens: the token file must parse."""
    data_dir = os.path.abspath(path)
    try:
        found = os.stat(data_dir)
    except (FileNotFoundError, NotADirectoryError):
        found = None
    except OSError as exc:
        raise UsageError("cannot use data dir %s: %s" % (data_dir, reason(exc))) from None
    if found is None and not create:
        raise UsageError("%s is not a data dir: no such directory" % data_dir)
    if found is not None and not stat.S_ISDIR(found.st_mode):
        raise UsageError("%s is not a data dir: not a directory" % data_dir)
    act_as_data_dir_owner(data_dir, log)
    if found is not None:
        check_data_dir_access(DataDir(data_dir), write=write, deep=deep)
    created = []
    try:
        if found is None:
            created = make_dirs(os.path.realpath(data_dir))
        if create:
            probe = os.path.join(data_dir, ".write-test")
            _remove(probe)  # (one a crash left, or a link: never followed)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600))
            os.unlink(probe)
    except PermissionError as exc:
        owner = user_name(os.stat(data_dir).st_uid) if os.path.isdir(data_dir) else None
        raise UsageError("cannot use data dir %s: %s%s" % (
            data_dir, reason(exc), "" if owner is None else "; it belongs to %s: run this as that "
            "user, e.g. sudo -u %s python3 oharness_sync.py ..." % (owner, owner))) from None
    except OSError as exc:
        raise UsageError("cannot use data dir %s: %s" % (data_dir, reason(exc))) from None
    if tokens:
        store = TokenStore(data_dir)
        try:
            # the tokens in force, before any work: a damaged file is the admin's to see now
            store.read()
        except (OSError, ValueError) as exc:
            raise UsageError("cannot use the token file %s: %s"
                             % (store.path, reason(exc))) from None
    return data_dir, created


def remove_new_data_dir(created, lock_path):
    """After a failed start, remove the data dir (and parents) that start made: its lock file
    (while still locked) and the directories while empty. Anything else in them stays, and so do
    the directories holding it."""
    try:
        os.unlink(lock_path)
    except OSError:
        pass
    for directory in reversed(created):
        try:
            os.rmdir(directory)
        except OSError:
            return


# What --data's help says of root (act_as_data_dir_owner), for the commands.
AS_OWNER_NOTE = "run by root on a dir another user owns, this works as that user"


def data_dir_flag(parser, note=AS_OWNER_NOTE):
    """--data DIR, as every command takes it; note: what this command does with it."""
    parser.add_argument("--data", required=True, metavar="DIR",
                        help="the server's data directory; " + note)


def retain_flag(parser):
    """--retain-deleted-days N, as serve, usage and compact take it (check_retain checks it)."""
    parser.add_argument("--retain-deleted-days", type=int, default=DEFAULT_RETAIN_DELETED_DAYS,
                        metavar="N",
                        help="a deleted session's records are erased by a compaction N days after "
                             "the deletion was stored (default %d)" % DEFAULT_RETAIN_DELETED_DAYS)


def check_retain(days):
    """--retain-deleted-days in milliseconds; UsageError when it is below 0."""
    if days < 0:
        raise UsageError("--retain-deleted-days must be 0 or more")
    return days * DAY_MS


def serve_command(argv, commands=()):
    """Serve (no COMMAND, or `serve`); commands: what its --help lists, each with a name and a
    summary (main's table; serving itself has no summary)."""
    listed = [command for command in commands if command.summary]
    width = max((len(command.name) for command in listed), default=0)
    parser = ArgumentParser(
        prog="oharness_sync.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--version] --data DIR [serving flags]\n"
              "       %(prog)s COMMAND [--help] ...",
        description="Serve OHarness session and memory sync (no COMMAND), or run a command:\n"
                    + "\n".join("  %s  %s" % (command.name.ljust(width), command.summary)
                                for command in listed))
    parser.add_argument("--version", action="version", version="oharness-sync %s" % __version__)
    data_dir_flag(parser, note="made if missing. Started by root on a dir another user owns, "
                               "the server binds its port and reads its key and token files, then "
                               "runs as that user (a dir root owns stays root's)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (default %s)" % DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="default %d; 0 picks a free port" % DEFAULT_PORT)
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="open connections at once (default %d); past it a new one gets 503"
                        % DEFAULT_MAX_CONNECTIONS)
    parser.add_argument("--max-connections-per-address", type=int, metavar="N",
                        help="open connections from one client address (IPv6: one /64; default a "
                             "quarter of --max-connections); past it a new one gets 503")
    parser.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDR",
                        help="a reverse proxy's address or network (repeat for more): its "
                             "connections are not counted per address, and its X-Forwarded-For "
                             "(or Forwarded) names the client")
    parser.add_argument("--max-parked", type=int, default=DEFAULT_MAX_PARKED,
                        help="long-polls held at once (default %d); past it a pull answers at once"
                        % DEFAULT_MAX_PARKED)
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_SECONDS,
                        metavar="SECONDS",
                        help="a request's headers and body must arrive within this, in total "
                             "(default %d)" % DEFAULT_REQUEST_SECONDS)
    retain_flag(parser)
    parser.add_argument("--metrics-token-file", metavar="FILE",
                        help="serve GET /metrics to whoever sends the token on this file's first "
                             "line (re-read on SIGHUP)")
    parser.add_argument("--principals-file", metavar="FILE",
                        help="serve only the principals this file lists, one a line, each with "
                             "an optional storage quota (`bob 2GiB`); re-read on SIGHUP")
    parser.add_argument("--reserve-disk", metavar="SIZE",
                        help="free space pushes and memory commits must leave on the data dir's "
                             "disk (default: the larger of 256MiB and 2%% of it; 0: off)")
    parser.add_argument("--quiet", action="store_true", help="no access log")
    parser.add_argument("--tls-cert", metavar="CERT.pem",
                        help="serve HTTPS with this certificate (chain)")
    parser.add_argument("--tls-key", metavar="KEY.pem",
                        help="and this private key; both are re-read on SIGHUP")
    add_auth_flags(parser)
    args = parser.parse_args(argv)
    log = Log(quiet=args.quiet)
    config = config_from_flags(args, log)
    try:
        listener = bind_listener(config.host, config.port)
    except OSError as exc:
        raise UsageError("cannot listen on %s:%d: %s"
                         % (config.host, config.port, reason(exc))) from None
    created, lock = [], None
    try:
        data_dir, created = open_data_dir(args.data, log, create=True, tokens=True)
        lock = DataDirLock(data_dir)
        lock.acquire()
        raise_open_file_limit()
        threading.stack_size(THREAD_STACK_BYTES)
        try:
            server = build_server(data_dir, config, log, listener)
        except OSError as exc:
            raise UsageError("cannot start the server on %s: %s%s" % (
                data_dir, "" if exc.filename is None else "%s: " % exc.filename,
                reason(exc))) from None
    except UsageError:
        listener.close()
        if created:  # a start that failed leaves no new directory behind
            remove_new_data_dir(created, lock.path)
        if lock is not None:
            lock.release()
        raise
    if config.tls is None and not is_loopback(config.host):
        log("warning: serving plain HTTP on %s; OHarness clients accept plain HTTP only for "
            "localhost, 127.0.0.1 and [::1]: put TLS in front of this server" % config.host)
    compactor = Compactor(server.app.feeds, config.retain_deleted_days, log)
    compactor.start()
    run_until_signalled(server, lambda: print("oharness-sync listening on %s" % server.url,
                                              flush=True))
    compactor.stop()
    lock.release()
    return 0


def config_from_flags(args, log):
    """The ServerConfig of serve's parsed flags, each checked, and the files they name read (what
    only root may read is read before root works as the data dir's owner; SIGHUP's re-reads are
    the owner's); UsageError naming the first flag that is wrong. log: where a JWKS that cannot
    be fetched or re-read is reported."""
    if not 0 <= args.port <= 65535:
        raise UsageError("--port must be 0..65535")
    if args.max_connections < 1:
        raise UsageError("--max-connections must be at least 1")
    if args.max_connections_per_address is not None and args.max_connections_per_address < 1:
        raise UsageError("--max-connections-per-address must be at least 1")
    try:
        trusted_proxies = tuple(trusted_proxy(text) for text in args.trusted_proxy)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not args.request_timeout > 0:
        raise UsageError("--request-timeout must be positive")
    if args.max_parked < 0:
        raise UsageError("--max-parked must be 0 or more")
    if args.memory_rate_limit < 0:
        raise UsageError("--memory-rate-limit must be 0 or more")
    check_retain(args.retain_deleted_days)
    metrics_token = (read_metrics_token(args.metrics_token_file)
                     if args.metrics_token_file else None)
    principals = principals_from_flag(args.principals_file)
    try:
        reserve = None if args.reserve_disk is None else parse_size(args.reserve_disk)
    except ValueError as exc:
        raise UsageError("--reserve-disk: %s" % exc) from None
    jwt, supabase = auth_from_flags(args, log)
    return ServerConfig(
        host=args.host, port=args.port, max_connections=args.max_connections,
        max_per_address=args.max_connections_per_address, trusted_proxies=trusted_proxies,
        max_parked=args.max_parked, request_seconds=args.request_timeout,
        retain_deleted_days=args.retain_deleted_days, metrics_token=metrics_token,
        metrics_token_file=args.metrics_token_file, principals=principals, reserve_disk=reserve,
        tls=tls_from_flags(args), jwt=jwt, memory_mode=args.memory_auth, supabase=supabase,
        memory_rate_limit=args.memory_rate_limit)


def principals_from_flag(path):
    """The PrincipalList of --principals-file, or None; UsageError naming what is wrong."""
    if path is None:
        return None
    try:
        return PrincipalList(path)
    except (OSError, ValueError) as exc:
        raise UsageError("cannot use the principals file %s: %s" % (path, reason(exc))) from None


def reload_files(server):
    """What a SIGHUP does: read the token file, the principals file, a JWKS file, the TLS files and
    the metrics token file again, each keeping what it had when it cannot; then log one line saying
    what was reloaded (and what was kept, and why)."""
    local, jwt = server.app.auth.local, server.app.auth.jwt
    done = []
    try:
        done.append("reloaded the token file %s (%s)"
                    % (local.tokens.path, plural(local.reload(), "token")))
    except (OSError, ValueError) as exc:
        done.append("%s: cannot read the token file %s: %s" % (
            "local tokens answered 503 until it is read"
            if isinstance(exc, OSError) and out_of_fds(exc) else "kept the tokens in force",
            local.tokens.path, reason(exc)))
    principals = server.app.auth.principals
    if principals is not None:
        try:
            done.append("reloaded the principals file %s (%s)"
                        % (principals.path, plural(principals.reload(), "principal")))
        except (OSError, ValueError) as exc:
            done.append("kept the principals in force: cannot use the principals file %s: %s"
                        % (principals.path, reason(exc)))
    jwks = jwt.jwks if jwt is not None else None
    if jwks is not None and jwks.path is not None:
        try:
            done.append("reloaded the JWKS file %s (%s)"
                        % (jwks.path, plural(jwks.reload(), "key")))
        except (OSError, ValueError) as exc:
            done.append("kept the JWKS keys in force: cannot read the JWKS file %s: %s"
                        % (jwks.path, reason(exc)))
    tls = server.tls
    if tls is not None:
        try:
            check_tls_files(tls.cert_path, tls.key_path)
            tls.context = tls.load()
            done.append("reloaded the TLS certificate %s and key %s"
                        % (tls.cert_path, tls.key_path))
        except UsageError as exc:
            done.append("kept the TLS certificate in force: %s" % exc)
        except (ssl.SSLError, OSError) as exc:  # changed again since it was checked
            done.append("kept the TLS certificate in force: cannot use %s: %s"
                        % (tls.cert_path, exc))
    metrics_token_file = server.config.metrics_token_file
    if metrics_token_file is not None:
        try:
            server.app.metrics_token = read_metrics_token(metrics_token_file)
            done.append("reloaded the metrics token file %s" % metrics_token_file)
        except UsageError as exc:
            done.append("kept the metrics token in force: %s" % exc)
    server.log("SIGHUP: " + "; ".join(done))


def run_until_signalled(server, ready):
    """Serve until SIGTERM or SIGINT, then stop gracefully: parked long-polls answer at once,
    in-flight pushes finish, and the process exits 0. ready() runs once the signals are handled:
    from then on, a SIGTERM is a graceful stop. A SIGHUP never stops it: it runs reload_files."""
    # The handlers only append (an Event's set() could deadlock on a lock its wait holds); the
    # byte each signal writes to wake_writer (set_wakeup_fd) ends the main thread's wait at once.
    signalled = []
    hangup = getattr(signal, "SIGHUP", None)  # none on Windows
    wake_reader, wake_writer = socket.socketpair()
    wake_writer.setblocking(False)
    previous = signal.set_wakeup_fd(wake_writer.fileno(), warn_on_full_buffer=False)
    try:
        for signum in (signal.SIGTERM, signal.SIGINT, hangup):
            if signum is not None:
                signal.signal(signum, lambda signum, frame: signalled.append(signum))
        threading.excepthook = lambda hook_args: server.log(
            "thread error: %s: %s" % (hook_args.exc_type.__name__, hook_args.exc_value))
        thread = threading.Thread(target=server.serve_forever,
                                  kwargs={"poll_interval": ACCEPT_POLL_SECONDS}, name="accept")
        thread.start()
        ready()
        while True:  # the re-reads are done here, not in the handler, which may interrupt anything
            while not signalled:
                select.select([wake_reader], [], [])
                wake_reader.recv(512)
            if signalled.pop(0) != hangup:
                break
            reload_files(server)
    finally:  # (a closed socket's fd number is soon another file's: no signal may write to it)
        signal.set_wakeup_fd(previous)
        wake_reader.close()
        wake_writer.close()
    server.stop(STOP_GRACE_SECONDS)
    pushes, fsyncs = server.app.feeds.commit_counts()
    server.log("stopped: %s made durable with %s"
               % (plural(pushes, "push"), plural(fsyncs, "fsync")))


# =================================================================================================
# Part II. The tools
#
# The sub-commands, each a client of Part I: first the protocol client that check and replicate
# talk to a server with; then token, fsck, note-hash, check, replicate, usage, compact, purge,
# backup and bench; main last.
# =================================================================================================


# -------------------------------------------------------------------------------------------------
# The protocol client
# -------------------------------------------------------------------------------------------------

CHECK_TIMEOUT = 15  # seconds for one whole request, its answer read; a long-poll's wait on top
CHECK_POLL_WAIT = 1  # long-poll-timeout's wait in seconds; long-poll-wakes parks its pull half
# of it before the push
# The most an answer may hold, head and body, in bytes. A pull page (this server's pages stop
# before 8 MiB of events, which JSON's escapes can at most triple), a project list, a memory
# snapshot or commit (16 MiB at most here) get the large limit; a push, health or identity answer,
# the small one.
LARGE_ANSWER_BYTES = 64 * 1024 * 1024
SMALL_ANSWER_BYTES = 1024 * 1024


class BadResponse(Exception):
    """A response of a shape the protocol does not allow: the message says what is wrong."""


class AnswerStopped(http.client.HTTPException):
    """An answer the client stopped reading (AnswerTimedOut, AnswerTooLarge); the message says
    which request, and why, in one line."""


class AnswerTimedOut(AnswerStopped):
    """The request and its whole answer took longer than the request's time."""


class AnswerTooLarge(AnswerStopped):
    """The answer passed the byte limit of its request."""


class ConnectFailed(Exception):
    """No connection (or TLS handshake) to url: error is the OSError it failed with; the message
    says the cause in words (connect_failure)."""

    def __init__(self, url, error):
        Exception.__init__(self, connect_failure(url, error))
        self.url = url
        self.error = error


# What an untrusted certificate's verify code says, in words (OpenSSL's X509_V_ERR_ numbers).
_CERTIFICATE_FAULTS = {
    62: "it is for another name: use in the URL a name (or address) the certificate holds",
    18: "it is self-signed: give it with --ca-file",
    19: "it is signed by a CA this machine does not trust: give the CA's certificate with "
        "--ca-file",
    20: "it is signed by a CA this machine does not trust: give the CA's certificate (not the "
        "server's) with --ca-file",
    10: "it has expired: the server needs a new one",
}


# What a TLS server answers to a name it has no certificate for: Caddy, internal_error; others,
# unrecognized_name.
_NO_CERTIFICATE_ALERTS = ("TLSV1_ALERT_INTERNAL_ERROR", "TLSV1_UNRECOGNIZED_NAME")


def token_from_flags(token, path, flag, command, required=False):
    """A bearer token given as flag (seen by other users in ps: a warning says so) or on the first
    line of the file at path (flag + "-file"); None when neither was given and it is not
    required."""
    if token is not None and path is not None:
        raise UsageError("give %s or %s-file, not both" % (flag, flag))
    if path is not None:
        return read_token_file(path, flag + "-file")
    if token is None:
        if required:
            raise UsageError("%s-file FILE (or %s) is required" % (flag, flag))
        return None
    if token[:7].lower() == "bearer ":
        raise UsageError("%s starts with \"Bearer \": give the token alone" % flag)
    if not _TOKEN_CHARACTERS.fullmatch(token):
        raise UsageError("%s must be printable ASCII without spaces" % flag)
    print("%s: warning: %s on the command line is visible to other users in ps; prefer %s-file"
          % (command, flag, flag), file=sys.stderr, flush=True)
    return token


def connect_failure(url, exc, ca_file=None):
    """The cause, in words, of a failed connection (or TLS handshake) to url; ca_file: the file
    of CA certificates the client trusted, if one was given."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        fault = _CERTIFICATE_FAULTS.get(
            exc.verify_code, "give the certificate of the CA that signed it with --ca-file")
        if ca_file is not None and exc.verify_code == 18:
            fault = "it is self-signed, and not the certificate in --ca-file %s" % ca_file
        elif ca_file is not None and exc.verify_code in (19, 20):
            fault = ("no CA in --ca-file %s signed it: give the certificate of the CA that did "
                     "(openssl verify -CAfile FILE CERTIFICATE tells)" % ca_file)
        return "the certificate of %s is not trusted (%s): %s" % (
            url, (exc.verify_message or reason(exc)).rstrip("."), fault)
    if isinstance(exc, ssl.SSLError) and exc.reason == "WRONG_VERSION_NUMBER":
        return ("the TLS handshake with %s failed: what answers there is not TLS (plain HTTP?): "
                "try http://" % url)
    if isinstance(exc, ssl.SSLError) and exc.reason in _NO_CERTIFICATE_ALERTS:
        return ("the TLS handshake with %s failed (%s): the server has no certificate for %s: use "
                "in the URL the name its certificate is for" % (
                    url, exc.reason, urllib.parse.urlsplit(url).hostname or "that name"))
    if isinstance(exc, ssl.SSLError):
        return "the TLS handshake with %s failed: %s" % (url, exc.reason or reason(exc))
    if isinstance(exc, ConnectionRefusedError):
        return ("cannot connect to %s: connection refused (is the server running, on that port?)"
                % url)
    if isinstance(exc, socket.gaierror):
        return "cannot connect to %s: the host name does not resolve (%s)" % (url, reason(exc))
    if isinstance(exc, socket.timeout):  # with https, the TCP connection or the TLS handshake
        return "cannot connect to %s: timed out%s" % (url, " (is it serving HTTPS on that port?)"
                                                      if url.startswith("https:") else "")
    return "cannot connect to %s: %s" % (url, reason(exc))


def excerpt(value, limit=200):
    """A short ASCII rendering of a document, for a message."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + "..."


def escaped(text):
    """text with each character that is not printable (a control character, a line separator, a
    direction override) as its Python escape: what a server sent never steers the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def parse_base_url(url, flag="--url"):
    """(https?, host, port) of http(s)://host[:port], with no path, query or credentials; else
    UsageError naming flag."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        parts = None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port == 0
            or parts.path not in ("", "/") or parts.query or parts.fragment
            or "@" in parts.netloc):
        raise UsageError("%s must be http(s)://host[:port], with no path, query or credentials"
                         % flag)
    https = parts.scheme == "https"
    return https, parts.hostname, port if port is not None else (443 if https else 80)


def is_loopback_host(host):
    """True for a loopback address (127.0.0.0/8, ::1), and for localhost when every address it
    resolves to is one; never for another name, whatever it starts with or resolves to now (a
    name's answer may change before the connection is made)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host.lower().rstrip(".") != "localhost":
        return False
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(found) and all(
        ipaddress.ip_address(address[4][0].split("%", 1)[0]).is_loopback for address in found)


def server_addresses(host, port):
    """The set of (address, port) that host:port resolves to; {(host, port)} when it does not."""
    try:
        found = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except OSError:
        return {(host.lower(), port)}
    return {(address[4][0], address[4][1]) for address in found}


class BoundedSocket:
    """A connection's socket as SyncClient uses it: each request gets a deadline for all of it
    (sending, waiting, every read of its answer together, not each read on its own) and a limit on
    the bytes of its answer, head and body, chunk lines included. Past either, AnswerStopped: so
    neither a body dripped a byte at a time nor one that never ends holds a tool up or fills its
    memory. The rest of what http.client asks of a socket is the socket's own."""

    def __init__(self, sock):
        self.sock = sock
        self.what = ""        # "METHOD /path to URL", for the messages
        self.seconds = 0.0
        self.deadline = self.limit = None
        self.received = 0
        self.readers = 0      # answers being read: closing waits for them, as a socket's does
        self.closing = False

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def begin(self, what, deadline, seconds, limit):
        """Bound the next request and its answer: by deadline (time.monotonic()) and limit
        bytes."""
        self.what, self.deadline, self.seconds = what, deadline, seconds
        self.limit, self.received = limit, 0

    def time_left(self):
        """Set the socket's time-out to what is left of the deadline; AnswerTimedOut when none
        is."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        self.sock.settimeout(left)

    def timed_out(self):
        return AnswerTimedOut("%s: no whole answer within %g s (a server that answers too slowly, "
                              "or never ends its answer)" % (self.what, self.seconds))

    def sendall(self, data):
        view = memoryview(data).cast("B")
        while view:
            self.time_left()
            try:
                sent = self.sock.send(view)
            except socket.timeout:
                raise self.timed_out() from None
            view = view[sent:]

    def recv_into(self, buffer):
        self.time_left()
        try:
            count = self.sock.recv_into(buffer)
        except socket.timeout:
            raise self.timed_out() from None
        self.received += count
        if self.received > self.limit:
            raise self.too_large()
        return count

    def too_large(self):
        return AnswerTooLarge("%s: the answer passed %s, the most taken for it (a server that "
                              "never ends its answer?)" % (self.what, format_bytes(self.limit)))

    def makefile(self, mode="rb", *args, **kwargs):
        """A buffered reader of an answer (http.client reads each answer through one)."""
        if mode != "rb":
            raise ValueError("a BoundedSocket only reads")
        return io.BufferedReader(AnswerReader(self))

    def close(self):
        self.closing = True
        if not self.readers:
            self.sock.close()


class AnswerReader(io.RawIOBase):
    """The raw reader under a BoundedSocket's makefile(): each read is the socket's recv_into."""

    def __init__(self, bounded):
        io.RawIOBase.__init__(self)
        self.bounded = bounded
        bounded.readers += 1

    def readable(self):
        return True

    def readinto(self, buffer):
        return self.bounded.recv_into(buffer)

    def close(self):
        if not self.closed:
            self.bounded.readers -= 1
            if self.bounded.closing:
                self.bounded.close()
        io.RawIOBase.close(self)


class SyncClient:
    """A small HTTP(S) client of one sync server (check, replicate): JSON bodies, the bearer token,
    and the protocol's requests (push, pull, projects, post_memory). Each returns (status, headers,
    document) whatever the status; the functions after this class check a 200's document.

    Every request is bounded (BoundedSocket): timeout seconds for all of it, connection included,
    and LARGE_ANSWER_BYTES for the answers that carry data (pull, projects, memory snapshot and
    commit), SMALL_ANSWER_BYTES for the others.

    exchange() sends one request on a connection of its own, or with keep_alive on the connection
    the previous keep_alive request left open; when that one turns out closed by the server (an
    idle keep-alive), the request is sent once more on a new connection. Every request of the
    protocol may be sent twice (pushes deduplicate, a commit carries its etag), so that is safe.
    """

    def __init__(self, url, token=None, context=None, timeout=CHECK_TIMEOUT, flag="--url",
                 ca_file=None):
        self.url = url
        self.https, self.host, self.port = parse_base_url(url, flag)
        self.token = token
        # an ssl.SSLContext for https (None: the system's trusted certificates, or ca_file's)
        self.context = context
        self.ca_file = ca_file                 # --ca-file, named when a certificate fails
        if ca_file is not None and not self.https:
            raise UsageError("--ca-file goes with an https:// URL")
        if ca_file is not None and context is None:
            try:
                self.context = ssl.create_default_context(cafile=ca_file)
            except ssl.SSLError:
                raise UsageError("cannot use --ca-file %s: it holds no certificate (a PEM file "
                                 "with BEGIN CERTIFICATE; is it a key?)" % ca_file) from None
            except (OSError, ValueError) as exc:
                raise UsageError("cannot use --ca-file %s: %s" % (ca_file, reason(exc))) from None
        self.timeout = timeout
        self._kept = None

    def connect(self, deadline):
        """A new connection, made by deadline (for https, its TLS handshake done); else
        ConnectFailed."""
        try:
            sock = socket.create_connection((self.host, self.port),
                                            max(0.001, deadline - time.monotonic()))
        except OSError as exc:  # refused, no such host: likely for good
            raise ConnectFailed(self.url, exc) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client does
            if self.https:
                if self.context is None:  # the system's trusted certificates, loaded once
                    self.context = ssl.create_default_context()
                sock = self.handshake(sock, deadline)
            conn = (http.client.HTTPSConnection(self.host, self.port, context=self.context)
                    if self.https else http.client.HTTPConnection(self.host, self.port))
        except OSError as exc:  # an untrusted certificate, no TLS there, a time-out
            sock.close()
            raise ConnectFailed(self.url, exc) from None
        conn.sock = BoundedSocket(sock)
        conn.auto_open = 0  # never a connection of http.client's own, which nothing would bound
        return conn

    def handshake(self, sock, deadline):
        """sock in TLS, its handshake done by deadline (socket.timeout when it is not): the
        handshake's reads are OpenSSL's, so the socket does not block and the waits are ours."""
        sock.setblocking(False)
        tls = self.context.wrap_socket(sock, server_hostname=self.host,
                                       do_handshake_on_connect=False)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                tls.close()
                raise socket.timeout("timed out")
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                select.select([tls], [], [], left)
            except ssl.SSLWantWriteError:
                select.select([], [tls], [], left)
            except OSError:
                tls.close()
                raise
        tls.setblocking(True)
        return tls

    def call(self, method, path, body=None, token=None, keep_alive=False, bounds=None):
        """(status, headers with lower-case names, document) of one request. body: a JSON document
        or its bytes (None: no body); token None sends ours, "" sends none; bounds: see exchange.
        The document is the body's JSON, else its first bytes as text (None for an empty body).
        Raises ConnectFailed, else OSError or http.client.HTTPException (AnswerStopped past the
        time or the byte limit) when the request fails."""
        data = body if body is None or isinstance(body, bytes) else encode_json(body)
        status, headers, raw = self.exchange(method, path, data, token=token,
                                             keep_alive=keep_alive, bounds=bounds)
        try:
            document = decode_json(raw, max_depth=None) if raw else None
        except ValueError:
            document = raw[:100].decode("utf-8", "replace")
        return status, headers, document

    def push(self, body, token=None, keep_alive=False):
        """A push of body (a JSON document or its bytes)."""
        return self.call("POST", "/v1/push", body, token, keep_alive=keep_alive)

    def pull(self, project, since, team=None, token=None, keep_alive=False, **params):
        """A pull of project's feed (team None: the personal one) from since; params: limit,
        wait."""
        query = dict(project=project, since=since, **params)
        if team is not None:
            query["team"] = team
        return self.call("GET", "/v1/pull?" + urllib.parse.urlencode(query), token=token,
                         keep_alive=keep_alive,
                         bounds=(self.timeout + params.get("wait", 0), LARGE_ANSWER_BYTES))

    def projects(self, team=None, token=None, keep_alive=False):
        """The list of projects with a feed (team None: personal feeds)."""
        query = "" if team is None else "?" + urllib.parse.urlencode({"team": team})
        return self.call("GET", "/v1/projects" + query, token=token, keep_alive=keep_alive,
                         bounds=(self.timeout, LARGE_ANSWER_BYTES))

    def post_memory(self, route, body, token=None, keep_alive=False):
        """A memory request: route is identity, snapshot or commit."""
        limit = SMALL_ANSWER_BYTES if route == "identity" else LARGE_ANSWER_BYTES
        return self.call("POST", "/v1/memory/" + route, body, token, keep_alive=keep_alive,
                         bounds=(self.timeout, limit))

    def exchange(self, method, path, data=None, token=None, keep_alive=False, bounds=None):
        """(status, headers with lower-case names, body bytes) of one request; data is a JSON body
        as bytes. token None sends ours; "" sends none. bounds (seconds, limit): all of it within
        seconds, the answer within limit bytes (None: the client's timeout, SMALL_ANSWER_BYTES).
        Raises ConnectFailed, OSError or http.client.HTTPException."""
        seconds, limit = bounds or (self.timeout, SMALL_ANSWER_BYTES)
        deadline = time.monotonic() + seconds
        limits = (deadline, seconds, limit)
        if not keep_alive:
            conn = self.connect(deadline)
            try:
                return self.send(conn, method, path, data, token=token, limits=limits)
            finally:
                conn.close()
        reused = self._kept is not None and self._kept.sock is not None
        for attempt in (1, 2):
            if self._kept is None or self._kept.sock is None:
                self.close()
                self._kept = self.connect(deadline)
            try:
                return self.send(self._kept, method, path, data, token=token, limits=limits)
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if (attempt == 2 or not reused
                        or not isinstance(exc, (ConnectionError, http.client.BadStatusLine))):
                    raise
        raise AssertionError("not reached")

    def send(self, conn, method, path, data, token, limits):
        """One request on conn, bounded by limits, (deadline, seconds, limit): by deadline (seconds
        after its start), its answer by limit bytes: (status, headers with lower-case names, body
        bytes)."""
        deadline, seconds, limit = limits
        bounded = conn.sock
        bounded.begin("%s %s of %s" % (method, path.split("?", 1)[0], self.url), deadline,
                      seconds, limit)
        headers = {}
        token = self.token if token is None else token
        if token:
            headers["Authorization"] = "Bearer " + token
        if data is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, path, data, headers)
        response = conn.getresponse()
        try:
            if response.length is not None and response.length > limit:
                raise bounded.too_large()
            if response.length is not None:
                raw = response.read()
            else:  # chunked, or up to the end of the connection: the socket's limit ends it
                parts = []
                while True:
                    part = response.read(65536)
                    if not part:
                        break
                    parts.append(part)
                raw = b"".join(parts)
        except BaseException:
            response.close()  # and with the connection, the socket: nothing more is read
            raise
        return response.status, {name.lower(): value for name, value in response.getheaders()}, raw

    def close(self):
        if self._kept is not None:
            self._kept.close()
            self._kept = None


# The shape of a 200's document, one function for each kind of response: each returns what it
# holds, checked, or raises BadResponse saying what is wrong with it.

def bad_response(what, wrong, document):
    """The BadResponse for a document of what (a push, a pull, ...) that is wrong in this way."""
    return BadResponse("the response to %s %s: %s" % (what, wrong, excerpt(document)))


def push_counts(document):
    """(cursor, accepted) of a push's response: {cursor, accepted}, both safe integers."""
    if not isinstance(document, dict):
        raise bad_response("a push", "is not an object", document)
    cursor, accepted = as_safe_int(document.get("cursor")), as_safe_int(document.get("accepted"))
    if cursor is None or accepted is None:
        raise bad_response("a push", "has no cursor and accepted (safe integers)", document)
    return cursor, accepted


def pull_page(document, since):
    """(cursor, records, sessions, more) of the response to a pull from since: {cursor (a safe
    integer, not below since), records and sessions (lists of objects), more (true or false)}; a
    page with events has a cursor past since, and more: true comes with events (else a client
    pulling on would loop for ever)."""
    if not isinstance(document, dict):
        raise bad_response("a pull", "is not an object", document)
    cursor = as_safe_int(document.get("cursor"))
    if cursor is None:
        raise bad_response("a pull", "has no cursor (a safe integer)", document)
    if cursor < since:
        raise bad_response("a pull", "has a cursor below since (%d)" % since, document)
    for name in ("records", "sessions"):
        events = document.get(name)
        if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
            raise bad_response("a pull", "has %s that are not a list of objects" % name, document)
    if not isinstance(document.get("more"), bool):
        raise bad_response("a pull", "has no more (true or false)", document)
    events = len(document["records"]) + len(document["sessions"])
    if document["more"] and cursor == since:
        raise bad_response("a pull", "repeats cursor %d with more: true (pulling on would never "
                                     "end)" % since, document)
    if document["more"] and not events:
        raise bad_response("a pull", "has more: true and no event", document)
    if events and cursor == since:
        raise bad_response("a pull", "has events and a cursor still at since (%d)" % since,
                           document)
    return cursor, document["records"], document["sessions"], document["more"]


def project_ids(document):
    """The project ids of a projects response: {projects: [ids]}."""
    projects = document.get("projects") if isinstance(document, dict) else None
    if not isinstance(projects, list) or not all(is_valid_id(project) for project in projects):
        raise bad_response("a projects request", "is not {projects: [ids]}", document)
    return projects


def check_principal(document, principal):
    """A memory response (any route) is an object that names principal, the one the request
    expected."""
    if not isinstance(document, dict):
        raise bad_response("a memory request", "is not an object", document)
    if document.get("principal") != principal:
        raise bad_response("a memory request", "names principal %s, not %s"
                           % (excerpt(document.get("principal")), excerpt(principal)), document)


def memory_entries(document):
    """{id: (hash or None, note or None)} of a memory snapshot or commit response's entries."""
    entries = document.get("entries") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise bad_response("a memory request", "has no list of entries", document)
    found = {}
    for entry in entries:
        if not isinstance(entry, dict) or not is_valid_id(entry.get("id")):
            raise bad_response("a memory request", "has an entry without a valid id", document)
        hash_value, note = entry.get("hash"), entry.get("note")
        if not (hash_value is None or isinstance(hash_value, str) and _HASH.fullmatch(hash_value)):
            wrong = "has entry %s with a malformed hash" % entry["id"]
            raise bad_response("a memory request", wrong, document)
        if note is not None and not isinstance(note, dict):
            wrong = "has entry %s with a malformed note" % entry["id"]
            raise bad_response("a memory request", wrong, document)
        found[entry["id"]] = (hash_value, note)
    return found


# -------------------------------------------------------------------------------------------------
# token: issue, list and revoke local tokens
# -------------------------------------------------------------------------------------------------

def token_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py token",
                            description="Manage local bearer tokens.")
    commands = parser.add_subparsers(dest="action", required=True)
    issue = commands.add_parser(
        "issue", help="issue a token and print it on stdout",
        description="Issue a local bearer token: the token alone on stdout, its id and principal "
                    "on stderr. A running server takes it within a second or two.")
    data_dir_flag(issue, note="made if missing; " + AS_OWNER_NOTE)
    issue.add_argument("--principal", required=True, metavar="ID",
                       help="whose token it is: the owner of their personal feeds and memory")
    issue.add_argument("--team", action="append", default=[], metavar="ID",
                       help="a team whose feeds the token may use (sync.team in the client); "
                            "give it again for more teams")
    issue.add_argument("--name", default="", metavar="LABEL",
                       help="a label for token list, e.g. the device it is for")
    issue.add_argument("--expires-days", type=float, metavar="N",
                       help="the token stops working N days from now (default: never)")
    issue.add_argument("--principals-file", metavar="FILE",
                       help="the server's --principals-file: warn when it does not list the "
                            "principal")
    listing = commands.add_parser("list", help="list tokens (never the tokens themselves)",
                                  description="List tokens: id, principal, teams, label, created, "
                                              "expires. Never the tokens themselves.")
    data_dir_flag(listing)
    revoke = commands.add_parser("revoke", help="revoke a token by its id (or the whole token)",
                                 description="Revoke a token; a running server refuses it within "
                                             "a second or two.")
    data_dir_flag(revoke)
    revoke.add_argument("token_id", metavar="TOKEN_ID",
                        help="the id token list shows, or the whole token")
    for sub in (issue, listing, revoke):
        sub.error = parser.error
    args = parser.parse_args(argv)
    if args.action == "issue":
        check_issue_flags(args)
    elif args.action == "revoke":
        token_id, hashed = revoked_token(args.token_id)
    data_dir, _ = open_data_dir(args.data, print_on_stderr, create=args.action == "issue",
                                write=args.action != "list", deep=False, tokens=True)
    tokens = TokenStore(data_dir)
    try:
        if args.action == "issue":
            return issue_token(tokens, args)
        if args.action == "list":
            return list_tokens(tokens)
        if not tokens.revoke(token_id, hashed):
            print("no token %s%s in %s (revoked already, or never issued here)"
                  % (token_id, "" if hashed is None else " with this secret", data_dir),
                  file=sys.stderr)
            return 1
        print("revoked token %s" % token_id, file=sys.stderr)
        return 0
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError("cannot change the token file %s: %s"
                         % (tokens.path, reason(exc))) from None


def revoked_token(given):
    """(token id, hash or None) of what `token revoke` was given: a token id, or a whole local
    token (then its hash must match too); UsageError, without echoing it (it may be a token), for
    anything else."""
    token_id = split_local_token(given)
    if token_id is not None:
        return token_id, token_hash(given)
    if _TOKEN_ID.fullmatch(given) is None:
        raise UsageError("give the token id, e.g. 3f9c2a17b0de (the ID column of `token list`), "
                         "or the whole token")
    return given, None


def check_issue_flags(args):
    """UsageError for a `token issue` whose flags are unusable: checked before the data dir is
    made."""
    for value in [args.principal] + args.team:
        if not is_valid_id(value):
            raise UsageError("%r is not a valid id ([A-Za-z0-9_-], 1 to 128 characters)" % value)
    if args.expires_days is not None and not args.expires_days > 0:
        raise UsageError("--expires-days must be positive")
    args.principals = principals_from_flag(args.principals_file)


def issue_token(tokens, args):
    token, record = tokens.issue(args.principal, args.team, args.name, args.expires_days)
    print(token, flush=True)
    print("issued token %s for principal %s" % (record["id"], record["principal"]),
          file=sys.stderr)
    if args.principals is not None and args.principal not in args.principals.quotas:
        print("warning: the principals file %s does not list %s: the server refuses this token "
              "(403) until it does" % (args.principals_file, args.principal), file=sys.stderr)
    return 0


def format_ms(value):
    if value is None:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(value / 1000))


def list_tokens(tokens):
    rows = [("ID", "PRINCIPAL", "TEAMS", "NAME", "CREATED (UTC)", "EXPIRES (UTC)")]
    for record in tokens.read():
        rows.append((record["id"], record["principal"], ",".join(record["teams"]) or "-",
                     record.get("name") or "-", format_ms(record.get("created")),
                     format_ms(record.get("expires"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


# -------------------------------------------------------------------------------------------------
# fsck: check a data dir
# -------------------------------------------------------------------------------------------------

class DataDirCheck:
    """Reads a whole data dir and lists what is wrong with it; read-only unless asked to repair.

    Problems are damage: a bad line, a number not above the one before, a record stored twice, a
    manifest, token or purged-feeds file that does not parse, a note whose object is missing or
    does not hash right. Notes are harmless findings (unreferenced revision objects, left by a
    crash or a replaced note; a compaction's file left aside by a crash). Repair drops a damaged
    line from the middle of a feed and keeps every other line (event numbers may skip), cuts a
    torn or damaged last line while its number stays used, and removes what the notes name.

    progress, if given, is called as progress(feeds done, feeds in all, bytes done, bytes in all)
    as the feeds are read: at each feed and every few thousand lines.
    """

    PROGRESS_LINES = 8192  # feed lines between two calls of progress

    def __init__(self, data_dir, repair=False, progress=None):
        self.data_dir = data_dir
        self.layout = DataDir(data_dir)
        self.repair = repair
        self.progress = progress
        self.problems = []
        self.notes = []
        self.repaired = []
        # something --repair would fix was found (and left, without --repair)
        self.repairable = False
        self.counts = {"feeds": 0, "events": 0, "scopes": 0, "notes": 0, "tokens": 0}
        self.feeds_total = self.bytes_total = self.bytes_done = 0

    def run(self):
        self.check_links()
        for path, name_file in self.layout.unnamed():
            self.problems.append("%s: named for a long id, but its name file %s is missing or "
                                 "does not match: what it holds is never listed (restore that "
                                 "file from a backup)" % (path, name_file))
        for path in self.layout.purge_leftovers():
            self.leftover(path, "what a purge a crash interrupted left (purge --principal ID "
                                "again finishes it too)")
        self.check_feeds()
        self.check_memory()
        self.check_tokens()
        return not self.problems

    # -- links ---------------------------------------------------------------

    def check_links(self):
        """A link anywhere in the data dir is damage (the server refuses it, never follows it);
        repair removes the link itself, never what it points to."""
        for path in self.layout.links():
            if self.repair:
                os.unlink(path)  # (unlink removes the link, never its target)
                sync_dir(os.path.dirname(path))
                self.repaired.append("%s: removed a link (what it pointed to is left alone)"
                                     % path)
            else:
                self.repairable = True
                self.problems.append("%s: a link, refused by the server (never followed); "
                                     "--repair removes the link, never its target" % path)

    # -- feeds ---------------------------------------------------------------

    def check_feeds(self):
        feeds = []  # (path, size)
        for owner, _, entry in self.layout.all_feeds():
            if owner is not None:
                feeds.append((entry.path, entry.stat().st_size))
            elif entry.name.endswith(".jsonl" + COMPACT_SUFFIX):
                self.leftover(entry.path, "a compaction's file left aside by a crash")
            else:
                self.notes.append("%s: not a feed file (left alone)" % entry.path)
        self.feeds_total, self.bytes_total = len(feeds), sum(size for _, size in feeds)
        for path, size in feeds:
            self._report_progress(0)
            self.check_feed(path)
            self.bytes_done += size
        self._report_progress(0)
        try:
            read_purged(self.layout)
        except OSError as exc:
            self.problems.append("cannot read %s: %s" % (self.layout.purged, reason(exc)))
        except ValueError as exc:
            self.problems.append("%s does not parse: %s" % (self.layout.purged, reason(exc)))

    def leftover(self, path, what):
        """A harmless file that --repair removes."""
        if self.repair:
            if os.path.isdir(path) and not os.path.islink(path):
                remove_tree(path)  # (synced)
            else:
                _remove(path)
                sync_dir(os.path.dirname(path))
            self.repaired.append("%s: removed %s" % (path, what))
        else:
            self.repairable = True
            self.notes.append("%s: %s (harmless; --repair removes it)" % (path, what))

    def _report_progress(self, feed_bytes):
        if self.progress is not None:
            self.progress(self.counts["feeds"], self.feeds_total, self.bytes_done + feed_bytes,
                          self.bytes_total)

    def check_feed(self, path):
        keys, damaged, torn, before = set(), [], None, 0
        with open_data_file(path) as f:
            for line_number, offset, line, number, kind, key, _, problem, last in scan_feed(f):
                if line_number % self.PROGRESS_LINES == 0:
                    self._report_progress(offset)
                if problem is not None and last:
                    torn = (line_number, offset, lost_number(line, before), problem)
                elif problem is not None:
                    damaged.append((line_number, problem))
                else:
                    before = number
                    if key is not None:
                        if key in keys:
                            self.problems.append("%s:%d: a record (session, id) stored a second "
                                                 "time" % (path, line_number))
                        keys.add(key)
                    self.counts["events"] += kind != b"x"
        self.counts["feeds"] += 1
        if damaged or torn:
            self._mend_feed(path, damaged, torn)

    def _mend_feed(self, path, damaged, torn):
        """Say what is damaged in a feed, and with --repair mend it: drop each damaged line from
        the middle (the file is rewritten aside and renamed over), cut a torn last one keeping
        its number."""
        if not self.repair:
            self.repairable = True
            for line_number, problem in damaged:
                self.problems.append("%s:%d: %s; --repair drops this line and keeps the others "
                                     "(the server refuses the feed until then)"
                                     % (path, line_number, problem))
            if torn:
                self.problems.append("%s:%d: torn or damaged last line (%s); --repair cuts it, "
                                     "and a running server cuts it at its next start"
                                     % (path, torn[0], torn[3]))
            return
        if damaged:
            drop = {line_number for line_number, _ in damaged}
            if torn:
                drop.add(torn[0])
            aside = aside_path(path)
            with open_data_file(path) as f, open_aside(path) as out:
                for line_number, line in enumerate(f, 1):
                    if line_number not in drop:
                        out.write(line)
                if torn:
                    out.write(feed_line(torn[2], b"x"))
                out.flush()
                sync_file(out.fileno())
            os.replace(aside, path)
            sync_dir(os.path.dirname(path))
            for line_number, problem in damaged:
                self.repaired.append("%s:%d: dropped a damaged line (%s)"
                                     % (path, line_number, problem))
        elif torn:
            cut_tail(path, torn[1], torn[2])
        if torn:
            self.repaired.append("%s:%d: cut a torn or damaged last line (%s); its number %d "
                                 "stays used" % (path, torn[0], torn[3], torn[2]))

    # -- memory ----------------------------------------------------------------

    def check_memory(self):
        for _, _, files in self.layout.all_scopes():
            self.check_scope(files)

    def check_scope(self, files):
        self.counts["scopes"] += 1
        manifest_path = files.manifest
        try:
            with open_data_file(manifest_path) as f:
                manifest = Manifest.from_bytes(f.read())
        except FileNotFoundError:
            manifest = NO_MANIFEST
        except (OSError, ValueError) as exc:
            self.problems.append("%s: manifest does not parse: %s" % (manifest_path, exc))
            return
        objects = files.objects
        referenced = set()
        for note_id in manifest.sorted_ids():
            entry = manifest.entries[note_id]
            if entry["hash"] is None:
                continue
            self.counts["notes"] += 1
            referenced.add(entry["rev"] + ".json")
            self.check_object(manifest_path, note_id, entry,
                              files.object_path(entry["rev"]))
        try:
            names = sorted(list_data_dir(objects))
        except (FileNotFoundError, LinkRefused):  # (a link: named by check_links)
            names = []
        unreferenced = [name for name in names
                        if name not in referenced and _OBJECT_NAME.fullmatch(name)]
        if unreferenced and self.repair:
            for name in unreferenced:
                os.unlink(os.path.join(objects, name))
            sync_dir(objects)
            self.repaired.append("%s: removed %s" % (
                objects, plural(len(unreferenced), "unreferenced revision object")))
        elif unreferenced:
            self.repairable = True
            self.notes.append("%s: %s (harmless; --repair removes %s)" % (
                objects, plural(len(unreferenced), "unreferenced revision object"),
                "it" if len(unreferenced) == 1 else "them"))

    def check_object(self, manifest_path, note_id, entry, path):
        try:
            with open_data_file(path) as f:
                data = f.read()
        except OSError:
            self.problems.append("%s: note %s: its object %s is missing"
                                 % (manifest_path, note_id, path))
            return
        try:
            note = decode_json(data)
            intact = isinstance(note, dict) and note_hash(note) == entry["hash"]
        except (ValueError, KeyError, TypeError):
            intact = False
        if not intact:
            self.problems.append("%s: note %s: its object %s does not hash to the manifest's hash"
                                 % (manifest_path, note_id, path))

    # -- tokens ----------------------------------------------------------------

    def check_tokens(self):
        tokens = TokenStore(self.data_dir)
        try:
            self.counts["tokens"] = len(tokens.read())
        except (OSError, ValueError) as exc:
            self.problems.append("%s: token file does not parse: %s" % (tokens.path, exc))

    def summary(self):
        counts = self.counts
        return ("fsck %s: %s with %s, %s with %s, %s: %s%s"
                % (self.data_dir, plural(counts["feeds"], "feed"),
                   plural(counts["events"], "event"), plural(counts["scopes"], "memory scope"),
                   plural(counts["notes"], "live note"),
                   plural(counts["tokens"], "token"), plural(len(self.problems), "problem"),
                   ", %d repaired" % len(self.repaired) if self.repaired else ""))


def fsck_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py fsck",
                            description="Check a data dir for damage.")
    data_dir_flag(parser)
    parser.add_argument("--repair", action="store_true",
                        help="cut torn last lines and remove unreferenced memory objects "
                             "(server stopped)")
    args = parser.parse_args(argv)
    data_dir, _ = open_data_dir(args.data, print_on_stderr, write=args.repair)
    lock = None
    if args.repair:  # a repair must not race the server's own appends
        lock = DataDirLock(data_dir, tool="fsck --repair")
        try:
            lock.acquire()
            lock.change()
        except UsageError:
            raise UsageError("stop the server using %s before --repair (a check without it is "
                             "safe while it runs)" % data_dir) from None
    # no progress in a log or a pipe
    progress = FsckProgress(sys.stderr) if sys.stderr.isatty() else None
    try:
        check = DataDirCheck(data_dir, repair=args.repair, progress=progress)
        check.run()
    finally:
        if lock is not None:
            lock.release()
    if progress is not None:
        progress.finish()
    for line in check.problems:
        print("problem: " + line)
    for line in check.repaired:
        print("repaired: " + line)
    for line in check.notes:
        print("note: " + line)
    print(check.summary())
    for line in fsck_remedies(check):
        print(line)
    return 0 if not check.problems else 1


def fsck_remedies(check):
    """The exact command that mends what check found, on a line of its own (none when it found
    nothing --repair mends)."""
    if not check.repairable:
        return []
    command = [sys.executable or "python3", os.path.abspath(__file__), "fsck", "--data",
               check.data_dir, "--repair"]
    return ["%s, with the server stopped: %s"
            % ("to repair" if check.problems else "to tidy up what is harmless",
               " ".join(shlex.quote(word) for word in command))]


class FsckProgress:
    """fsck's progress on a terminal: one line on stderr, rewritten in place a few times a second,
    and left standing at the end with the time taken."""

    INTERVAL = 0.25  # seconds between two rewrites

    def __init__(self, stream, clock=time.monotonic):
        self.stream = stream
        self.clock = clock
        self.started = clock()
        self.shown_at = None
        self.width = 0
        self.last = None

    def __call__(self, feeds_done, feeds_total, bytes_done, bytes_total):
        self.last = (feeds_done, feeds_total, bytes_done, bytes_total)
        now = self.clock()
        if self.shown_at is None or now - self.shown_at >= self.INTERVAL:
            self.shown_at = now
            self.show("")

    def show(self, end):
        feeds_done, feeds_total, bytes_done, bytes_total = self.last
        text = "fsck: feeds %d/%d, %s of %s" % (feeds_done, feeds_total, format_bytes(bytes_done),
                                                format_bytes(bytes_total))
        if end:
            text += " in %.1f s" % (self.clock() - self.started)
        self.stream.write("\r" + text.ljust(self.width) + end)
        self.stream.flush()
        self.width = len(text)

    def finish(self):
        """Leave the last state on its own line, with the time taken (memory and tokens
        included)."""
        if self.last is not None:
            self.show("\n")


# -------------------------------------------------------------------------------------------------
# note-hash: a memory note's hash
# -------------------------------------------------------------------------------------------------

def note_hash_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py note-hash",
                            description="Print the hash a memory commit needs for a note: the "
                                        "lowercase hex SHA-256 of JSON.stringify([id, summary, "
                                        "body, tags, createdAt(, type)]).")
    parser.add_argument("file", metavar="FILE",
                        help="the note as a JSON object; - reads standard input")
    args = parser.parse_args(argv)
    name = "standard input" if args.file == "-" else args.file
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise UsageError("cannot read %s: %s" % (name, reason(exc))) from None
    try:
        note = validate_note(decode_json(data), MEMORY_QUOTA["maxNoteBytes"])
    except InvalidNote as exc:
        raise UsageError("%s is not a valid note: %s" % (name, exc)) from None
    except ValueError as exc:  # decode_json's reasons speak of a "body"
        raise UsageError("%s is not a JSON note: %s"
                         % (name, str(exc).replace("body ", "it ", 1))) from None
    print(note_hash(note))
    return 0


# -------------------------------------------------------------------------------------------------
# check: does a server speak protocol v1?
# -------------------------------------------------------------------------------------------------

CHECK_PROJECTS = ("smoke", "paging", "poll", "bodies", "listed", "unpushed", "shared", "mine",
                  "team", "noteam", "memory")

# Bodies that must come back equal as JSON values. Every number is exact as a
# double, so a server written in JavaScript passes too.
CHECK_BODIES = [
    {"text": "h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c\u8a9e",
     "emoji": "\U0001f600\U0001f44d\U0001f3fd",
     "separators": "\u2028\u2029", "controls": "\x00\x1f\x7f \\ \" /"},
    [9007199254740991, -9007199254740991, 1e300, 5e-324, 0.1, -2.5, 0],
    {"deep": [[[[{"a": [None, True, False, {}, []]}]]]]},
    None,
    "",
]
CHECK_LONE_SURROGATES = "\ud800 lone high, \udfff lone low"

# The note memory-commit creates: non-ASCII text, a type, and updatedAt (which is not hashed).
CHECK_NOTE = {"id": "ohs-check-note", "summary": "Written by oharness_sync.py check",
              "body": "A test note, safe to delete. \u00c9t\u00e9 \u2713 \U0001f600",
              "tags": ["ohs-check"], "type": "reference", "createdAt": 1789344000000,
              "updatedAt": 1789345000000}


class CheckFailed(Exception):
    """One conformance check failed; the message is the reason."""


class CheckStopped(Exception):
    """Every further request would fail the same way (no connection, an untrusted certificate,
    the token refused): the message is the cause, said once, and no further check runs."""


def redirect_stop(url, location):
    """Why check stops at a redirect from url to location: the address to give as --url (a base
    URL has no path: https://pi/v1/health gives https://pi), else where it points."""
    try:
        target = urllib.parse.urlsplit(location or "")
    except ValueError:  # "Invalid IPv6 URL": a bracket out of place
        target = urllib.parse.urlsplit("")
    if target.scheme in ("http", "https") and target.netloc:
        return ("%s redirects to %s: give --url %s://%s (with --ca-file for a private CA)"
                % (url, location, target.scheme, target.netloc))
    return "%s redirects to %s: give the address it points to as --url" % (
        url, location or "another place")


def check_record(record_id, body="unchanged"):
    """A well-formed record for the checks' pushes."""
    return {"session": "s1", "id": record_id, "seq": 1, "device": "ohs-check", "at": 1,
            "body": body}


class CheckRequests:
    """The requests of a conformance check, on one SyncClient: each answer's status and shape
    expected (CheckFailed), or CheckStopped when every further request would fail the same way.
    first_answer() is called at the first HTTP response, before anything is written."""

    def __init__(self, client, principal, first_answer):
        self.client = client
        self.url = client.url
        self.principal = principal  # a memory request's expectedPrincipal
        self.first_answer = first_answer
        self.responded = False  # no HTTP response yet: nothing written

    def response(self, send):
        """(status, headers, document) of send(), a function that sends one request with
        self.client; CheckStopped when no connection is made, or a first request has no response
        (every further request would fail the same way)."""
        try:
            status, headers, document = send()
        except ConnectFailed as exc:  # refused, no such host, an untrusted certificate
            failure = connect_failure(exc.url, exc.error, self.client.ca_file)
            raise CheckStopped(failure) from None
        except AnswerStopped as exc:  # every further request would likely end the same way
            raise CheckStopped(str(exc)) from None
        except (OSError, http.client.HTTPException) as exc:
            if self.responded:
                raise
            # No HTTP response yet: likely not an HTTP server (or TLS where http:// was given).
            hint = "" if self.client.https else ": if it serves HTTPS, give an https:// URL"
            raise CheckStopped("no HTTP response from %s to a first request (%s)%s"
                               % (self.url, str(exc) or type(exc).__name__, hint)) from None
        if not self.responded and status in (301, 302, 307, 308):
            raise CheckStopped(redirect_stop(self.url, headers.get("location")))
        if not self.responded:  # the checks write from now on: say where, once
            self.responded = True
            self.first_answer()
        return status, headers, document

    def expect(self, what, send, status=200, token=None):
        """The document of send()'s response (what: "METHOD /path", for messages); CheckFailed
        unless it has this status (and, for 200, Content-Type application/json); CheckStopped
        when a session route refuses --token itself (every other request would too)."""
        got, headers, document = self.response(send)
        if got == 401 and status != 401 and token is None and " /v1/memory/" not in what:
            raise CheckStopped("the server refuses the token: %s answered 401 %s (is it a token "
                               "of this server, not revoked or expired?)"
                               % (what.split("?", 1)[0], excerpt(document)))
        if got == 401 and status != 401 and token is None:  # a memory route
            code = document.get("code") if isinstance(document, dict) else None
            raise CheckFailed("%s answered 401 %s: the server does not take --token for memory "
                              "sync (which tokens it takes there: see %s)"
                              % (what, code or excerpt(document), MEMORY_CLIENT_NOTE))
        if got != status:
            raise CheckFailed("%s answered %d, expected %d: %s"
                              % (what, got, status, excerpt(document)))
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if status == 200 and content_type != "application/json":
            raise CheckFailed("%s answered with Content-Type %r" % (what, content_type))
        return document

    def call(self, method, path, status=200, token=None):
        """The document of a request without a body, of a route with no call of its own."""
        return self.expect("%s %s" % (method, path),
                           lambda: self.client.call(method, path, token=token), status, token)

    def push(self, project, records=(), sessions=(), token=None, team=None, status=200):
        body = {"project": project, "records": list(records), "sessions": list(sessions)}
        if team is not None:
            body["team"] = team
        document = self.expect("POST /v1/push", lambda: self.client.push(body, token), status,
                               token)
        if status == 200:
            push_counts(document)
        return document

    def pull(self, project, since, token=None, team=None, status=200, **params):
        document = self.expect("GET /v1/pull", lambda: self.client.pull(
            project, since, team=team, token=token, **params), status, token)
        if status == 200:
            pull_page(document, since)
        return document

    def list_projects(self, token=None, team=None):
        document = self.expect("GET /v1/projects",
                               lambda: self.client.projects(team=team, token=token), token=token)
        return project_ids(document)

    def post_memory(self, route, status=200, **fields):
        body = dict(fields, expectedPrincipal=self.principal)
        document = self.expect("POST /v1/memory/" + route,
                               lambda: self.client.post_memory(route, body), status)
        if not isinstance(document, dict):
            raise CheckFailed("POST /v1/memory/%s answered %s, not an object"
                              % (route, excerpt(document)))
        if status == 200:
            check_principal(document, self.principal)
            if route != "identity":
                memory_entries(document)
        return document


class ConformanceCheck:
    """Checks over HTTP(S) that a server, ours or another, behaves as protocol v1 requires.

    run() prints one line per check, `PASS name` or `FAIL name: reason`, or stops at a
    CheckStopped with one line that says why. The checks write to fresh projects named
    ohs-check-<random>-<purpose>; notice() is printed on err at the first response, before
    anything is written. Their requests are self.requests (CheckRequests).
    """

    def __init__(self, client, other_token=None, team=None, principal=None, out=None, err=None):
        self.url = client.url
        self.client = client                   # a SyncClient (check_client)
        # the notice is printed at the first response, before anything is written
        self.requests = CheckRequests(client, principal,
                                      lambda: print(self.notice(), file=self.err, flush=True))
        self.err = err or sys.stderr
        self.token = client.token
        self.other_token = other_token
        self.team = team
        self.principal = principal
        self.out = out or sys.stdout
        base = "ohs-check-" + secrets.token_hex(4)
        self.project = {name: base + "-" + name for name in CHECK_PROJECTS}
        self.memory_etag = None  # set by memory-commit, used by the memory checks after it

    def checks(self):
        """(name, method) for every check the options ask for, in order."""
        checks = [("health", self.check_health), ("auth-required", self.check_auth_required),
                  ("smoke-test", self.check_smoke_test), ("paging", self.check_paging),
                  ("long-poll-wakes", self.check_long_poll_wakes),
                  ("long-poll-timeout", self.check_long_poll_timeout),
                  ("body-round-trip", self.check_body_round_trip),
                  ("projects", self.check_projects)]
        if self.other_token:
            checks.append(("isolation", self.check_isolation))
        if self.team:
            checks.append(("team-feed", self.check_team_feed))
        checks.append(("unknown-team", self.check_unknown_team))
        if self.principal:
            checks += [("memory-identity", self.check_memory_identity),
                       ("memory-empty-snapshot", self.check_memory_empty_snapshot),
                       ("memory-commit", self.check_memory_commit),
                       ("memory-stale-etag", self.check_memory_stale_etag),
                       ("memory-delete", self.check_memory_delete)]
        return checks

    def notice(self):
        """The one line that says what test data this leaves behind, and where: the projects it
        pushes to (those it only pulls from, or pushes to and is refused, are never created)."""
        names = ["smoke", "paging", "poll", "bodies", "listed"]
        if self.other_token:
            names += ["shared", "mine"]
        if self.team:
            names.append("team")
        where = "projects %s" % ", ".join(self.project[name] for name in names)
        if self.other_token:
            where += " (%s also for the other token's principal)" % self.project["shared"]
        if self.team:
            where += " (%s also in team %s)" % (self.project["team"], self.team)
        if self.principal:
            where += ("; memory project %s of principal %s"
                      % (self.project["memory"], self.principal))
        return "check: writing test data to %s: %s" % (self.url, where)

    def run(self):
        """Run the checks; True when every one passed. Never raises for what the server does."""
        count = [0, 0]  # passed, failed
        for name, check in self.checks():
            try:
                check()
            except CheckStopped as exc:
                print("check stopped: %s" % escaped(self.redacted(str(exc))), file=self.out,
                      flush=True)
                return False
            except (CheckFailed, BadResponse) as exc:
                failure = str(exc)
            except (OSError, http.client.HTTPException) as exc:
                failure = "network error: %s" % (str(exc) or type(exc).__name__)
            except Exception as exc:
                # a response of an unexpected shape, from a server we do not know
                failure = "unexpected response (%s: %s)" % (type(exc).__name__, exc)
            else:
                print("PASS %s" % name, file=self.out, flush=True)
                count[0] += 1
                continue
            count[1] += 1
            print("FAIL %s: %s" % (name, escaped(self.redacted(failure))), file=self.out,
                  flush=True)
        print("check: %d passed, %d failed" % tuple(count), file=self.out, flush=True)
        return not count[1]

    def redacted(self, text):
        for secret in (self.token, self.other_token):
            if secret:
                text = text.replace(secret, "<token>")
        return text

    # -- session sync ----------------------------------------------------------

    def check_health(self):
        doc = self.requests.call("GET", "/v1/health", token="")
        if not (isinstance(doc, dict) and doc.get("ok") is True):
            raise CheckFailed("GET /v1/health answered %s, expected {\"ok\": true}" % excerpt(doc))

    def check_auth_required(self):
        """Every data route is 401 with WWW-Authenticate: Bearer, without a token or with a
        made-up one."""
        # the smoke test then shows that these pushes stored nothing
        project = self.project["smoke"]
        routes = [("GET", "/v1/projects", None),
                  ("GET", "/v1/pull?project=%s&since=0" % project, None),
                  ("POST", "/v1/push", {"project": project, "records": [check_record("r1")]})]
        made_up = "ohs-check-" + secrets.token_hex(16)
        for method, path, body in routes:
            for token, what in (("", "without a token"), (made_up, "with a made-up token")):
                status, headers, doc = self.requests.response(
                    lambda: self.client.call(method, path, body, token))
                if status != 401:
                    raise CheckFailed("%s %s %s answered %d, expected 401"
                                      % (method, path, what, status))
                if not headers.get("www-authenticate", "").lower().startswith("bearer"):
                    raise CheckFailed("the 401 to %s %s has no WWW-Authenticate: Bearer"
                                      % (method, path))
                if not (isinstance(doc, dict) and isinstance(doc.get("error"), str)):
                    raise CheckFailed("the 401 to %s %s is %s, not {\"error\": text}"
                                      % (method, path, excerpt(doc)))

    def check_smoke_test(self):
        """The seed's smoke test: push, push again (accepted 0), pull, then pull from the cursor
        (empty)."""
        project, pushed = self.project["smoke"], check_record("r1", {"value": "unchanged"})
        first = self.requests.push(project, [pushed])
        if first["accepted"] != 1:
            raise CheckFailed("the first push answered %s, expected accepted 1" % excerpt(first))
        again = self.requests.push(project, [pushed])
        if again != {"cursor": first["cursor"], "accepted": 0}:
            raise CheckFailed("pushing the same record again answered %s, expected accepted 0 and "
                              "cursor %d" % (excerpt(again), first["cursor"]))
        page = self.requests.pull(project, 0, limit=500)
        if page != {"cursor": first["cursor"], "records": [pushed], "sessions": [], "more": False}:
            raise CheckFailed("pull from 0 answered %s, expected the one record and cursor %d"
                              % (excerpt(page), first["cursor"]))
        after = self.requests.pull(project, first["cursor"])
        if after != {"cursor": first["cursor"], "records": [], "sessions": [], "more": False}:
            raise CheckFailed("pull from cursor %d answered %s, expected nothing and the same "
                              "cursor" % (first["cursor"], excerpt(after)))

    def check_paging(self):
        """Five records pulled two at a time: the cursor advances, more is true until the last
        page."""
        project, ids = self.project["paging"], ["r%d" % i for i in range(5)]
        end = self.requests.push(project, [check_record(record_id) for record_id in ids])["cursor"]
        seen, since = [], 0
        for _ in range(len(ids) + 1):
            page = self.requests.pull(project, since, limit=2)
            events = len(page["records"]) + len(page["sessions"])
            if not 0 < events <= 2 or page["cursor"] <= since:
                raise CheckFailed("pull with since=%d and limit=2 answered %s"
                                  % (since, excerpt(page)))
            seen += [record.get("id") for record in page["records"]]
            since = page["cursor"]
            if page["more"] != (len(seen) < len(ids)):
                raise CheckFailed("more was %s after %d of %d records"
                                  % (page["more"], len(seen), len(ids)))
            if not page["more"]:
                break
        if seen != ids or since != end:
            raise CheckFailed("the pages gave %s up to cursor %d, expected %s up to %d"
                              % (seen, since, ids, end))

    def check_long_poll_wakes(self):
        """A pull parked with wait=10 answers with the record as soon as it is pushed."""
        project, result = self.project["poll"], {}

        def parked_pull():
            try:
                result["page"] = self.requests.pull(project, 0, wait=10)
            except Exception as exc:  # reported by the check below
                result["error"] = exc
            result["at"] = time.monotonic()

        thread = threading.Thread(target=parked_pull, daemon=True)
        thread.start()
        time.sleep(CHECK_POLL_WAIT / 2)
        if "error" in result:
            raise result["error"]
        if not thread.is_alive():
            raise CheckFailed("a pull with wait=10 on an empty feed did not wait: %s"
                              % excerpt(result.get("page")))
        pushed_at = time.monotonic()
        self.requests.push(project, [check_record("wake")])
        thread.join(CHECK_TIMEOUT + 10)
        if "error" in result:
            raise result["error"]
        if thread.is_alive():
            raise CheckFailed("the parked pull was not answered")
        ids = [record.get("id") for record in result["page"]["records"]]
        delay = result["at"] - pushed_at
        if ids != ["wake"] or delay > 3:
            raise CheckFailed("the parked pull answered %.1f s after a push with records %s, "
                              "expected [\"wake\"] at once" % (delay, ids))

    def check_long_poll_timeout(self):
        """A pull with wait=1 (CHECK_POLL_WAIT) and nothing new answers 200, empty, after about
        a second."""
        project, wait = self.project["poll"], CHECK_POLL_WAIT
        end = self.requests.push(project, [check_record("quiet")])["cursor"]
        started = time.monotonic()
        page = self.requests.pull(project, end, wait=wait)
        elapsed = time.monotonic() - started
        if page != {"cursor": end, "records": [], "sessions": [], "more": False}:
            raise CheckFailed("pull with wait=%d from the end answered %s" % (wait, excerpt(page)))
        if not 0.9 * wait <= elapsed <= wait + 4:
            raise CheckFailed("pull with wait=%d answered after %.2f s, expected about %d s"
                              % (wait, elapsed, wait))

    def check_body_round_trip(self):
        """Bodies come back equal as JSON values; a lone surrogate stays an escape (valid
        UTF-8)."""
        project = self.project["bodies"]
        records = [check_record("r%d" % i, body) for i, body in enumerate(CHECK_BODIES)]
        sessions = [{"id": "s1", "gen": 0, "updatedAt": 1, "body": {"meta": CHECK_BODIES[0]}}]
        self.requests.push(project, records, sessions)
        records.append(check_record("lone", CHECK_LONE_SURROGATES))
        # a push of its own: encode_json writes it all as ASCII escapes
        self.requests.push(project, records[-1:])
        page = self.requests.pull(project, 0)
        if page["records"] != records or page["sessions"] != sessions:
            for pushed, pulled in zip(records + sessions, page["records"] + page["sessions"]):
                if pushed != pulled:
                    raise CheckFailed("pushed %s, pulled %s" % (excerpt(pushed), excerpt(pulled)))
            raise CheckFailed("pushed %d records and %d session entries, pulled %d and %d" % (
                len(records), len(sessions), len(page["records"]), len(page["sessions"])))

    def check_projects(self):
        """/v1/projects lists a project pushed to and not one that was only pulled."""
        listed, unpushed = self.project["listed"], self.project["unpushed"]
        self.requests.push(listed, [check_record("r1")])
        self.requests.pull(unpushed, 0)
        projects = self.requests.list_projects()
        if listed not in projects or unpushed in projects:
            raise CheckFailed("GET /v1/projects answered %s: expected %s in it and %s not"
                              % (excerpt(projects), listed, unpushed))

    def check_isolation(self):
        """Two principals, one project id: each sees only its own records and project list."""
        shared, mine = self.project["shared"], self.project["mine"]
        first, second = (check_record("r1", "first principal"),
                         check_record("r1", "second principal"))
        self.requests.push(shared, [first])
        self.requests.push(mine, [first])
        theirs = self.requests.push(shared, [second], token=self.other_token)
        if theirs["accepted"] != 1:
            raise CheckFailed("the other token's push to the same project id answered %s, "
                              "expected accepted 1 (are both tokens for one principal?)"
                              % excerpt(theirs))
        for token, expected in ((None, first), (self.other_token, second)):
            records = self.requests.pull(shared, 0, token=token)["records"]
            if records != [expected]:
                raise CheckFailed("%s token pulled %s, expected only %s"
                                  % ("the" if token is None else "the other", excerpt(records),
                                     excerpt([expected])))
        projects = self.requests.list_projects(token=self.other_token)
        if mine in projects or shared not in projects:
            raise CheckFailed("the other token's /v1/projects answered %s: expected %s in it and "
                              "%s not" % (excerpt(projects), shared, mine))

    def check_team_feed(self):
        """The team's feed and the personal feed are separate."""
        project, personal, team = (self.project["team"], check_record("personal"),
                                   check_record("team"))
        self.requests.push(project, [personal])
        self.requests.push(project, [team], team=self.team)
        feeds = (("personal", self.requests.pull(project, 0)["records"], personal),
                 ("team", self.requests.pull(project, 0, team=self.team)["records"], team))
        for where, records, expected in feeds:
            if records != [expected]:
                raise CheckFailed("the %s feed holds %s, expected only %s"
                                  % (where, excerpt(records), excerpt([expected])))
        if project not in self.requests.list_projects(team=self.team):
            raise CheckFailed("GET /v1/projects?team=%s does not list %s" % (self.team, project))

    def check_unknown_team(self):
        """A team the token does not list is 403 everywhere, never a fallback to the personal
        feed."""
        project, team = self.project["noteam"], "ohs-check-" + secrets.token_hex(8)
        self.requests.push(project, [check_record("r1")], team=team, status=403)
        self.requests.pull(project, 0, team=team, status=403)
        self.requests.call("GET", "/v1/projects?team=" + team, status=403)
        records = self.requests.pull(project, 0)["records"]
        if records:
            raise CheckFailed("the push to an unknown team was stored in the personal feed: %s"
                              % excerpt(records))

    # -- memory sync -----------------------------------------------------------

    def check_memory_identity(self):
        quota = self.requests.post_memory("identity").get("quota")
        if not (isinstance(quota, dict)
                and all(as_safe_int(quota.get(key)) is not None for key in MEMORY_QUOTA)):
            raise CheckFailed("identity answered quota %s, expected the keys %s"
                              % (excerpt(quota), ", ".join(sorted(MEMORY_QUOTA))))

    def check_memory_empty_snapshot(self):
        doc = self.requests.post_memory("snapshot", project=self.project["memory"])
        if doc.get("etag") is not None or doc.get("entries") != []:
            raise CheckFailed("the snapshot of a new project is %s, expected etag null and no "
                              "entries" % excerpt(doc))

    def check_memory_commit(self):
        """Create one note; the response and the next snapshot hold it, under a new etag."""
        project, note = self.project["memory"], CHECK_NOTE
        entry = {"id": note["id"], "hash": note_hash(note), "note": note}
        doc = self.requests.post_memory("commit", project=project, etag=None, changes=[entry])
        if not isinstance(doc.get("etag"), str) or doc.get("entries") != [entry]:
            raise CheckFailed("the commit answered %s, expected an etag and the note"
                              % excerpt(doc))
        snapshot = self.requests.post_memory("snapshot", project=project)
        if snapshot.get("etag") != doc["etag"] or snapshot.get("entries") != [entry]:
            raise CheckFailed("the snapshot after the commit is %s" % excerpt(snapshot))
        self.memory_etag = doc["etag"]

    def check_memory_stale_etag(self):
        """A commit from a stale etag is 409 revision_conflict and publishes nothing."""
        project, etag = self.project["memory"], self.needs_memory_commit()
        note = dict(CHECK_NOTE, id="ohs-check-stale")
        doc = self.requests.post_memory("commit", status=409, project=project, etag=None,
                          changes=[{"id": note["id"], "hash": note_hash(note), "note": note}])
        if doc.get("code") != "revision_conflict":
            raise CheckFailed("the 409 is %s, expected code revision_conflict" % excerpt(doc))
        snapshot = self.requests.post_memory("snapshot", project=project)
        if snapshot.get("etag") != etag or len(snapshot.get("entries") or ()) != 1:
            raise CheckFailed("after the refused commit the snapshot is %s" % excerpt(snapshot))

    def check_memory_delete(self):
        """A delete leaves a tombstone {id, hash: null} in the next snapshot."""
        project, etag, note_id = (self.project["memory"], self.needs_memory_commit(),
                                  CHECK_NOTE["id"])
        self.requests.post_memory("commit", project=project, etag=etag,
                         changes=[{"id": note_id, "hash": None}])
        entries = self.requests.post_memory("snapshot", project=project).get("entries")
        if entries != [{"id": note_id, "hash": None}]:
            raise CheckFailed("the snapshot after the delete holds %s, expected only the tombstone"
                              % excerpt(entries))

    def needs_memory_commit(self):
        if self.memory_etag is None:
            raise CheckFailed("needs memory-commit, which failed")
        return self.memory_etag


def check_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py check",
                            description="Check that a sync server, this one or another, speaks "
                                        "protocol v1. It writes test data to fresh projects: use "
                                        "a throwaway token.")
    parser.add_argument("--url", required=True,
                        help="the server's base URL, http(s)://host[:port]")
    parser.add_argument("--token-file", metavar="FILE",
                        help="a file whose first line is a bearer token for session sync")
    parser.add_argument("--token", help="the token itself (other users see it in ps: prefer "
                                        "--token-file)")
    parser.add_argument("--other-token-file", metavar="FILE",
                        help="a token of another principal, on a file's first line: checks "
                             "isolation")
    parser.add_argument("--other-token", metavar="TOKEN",
                        help="that token itself (seen in ps)")
    parser.add_argument("--team", metavar="ID",
                        help="a team the token lists: checks the team feed")
    parser.add_argument("--memory", action="store_true",
                        help="check memory sync too (with --principal)")
    parser.add_argument("--principal", metavar="ID", help="the principal the token belongs to")
    parser.add_argument("--ca-file", metavar="CERT.pem",
                        help="trust this certificate (or CA bundle) for an https:// URL: for a "
                             "self-signed one")
    args = parser.parse_args(argv)
    token = token_from_flags(args.token, args.token_file, "--token", "check", required=True)
    other = token_from_flags(args.other_token, args.other_token_file, "--other-token", "check")
    if args.memory != (args.principal is not None):
        raise UsageError("--memory and --principal go together")
    if args.principal is not None and not is_valid_id(args.principal):
        raise UsageError("--principal must be an id ([A-Za-z0-9_-], 1 to 128 characters)")
    client = SyncClient(args.url, token, timeout=CHECK_TIMEOUT, ca_file=args.ca_file)
    check = ConformanceCheck(client, other_token=other, team=args.team, principal=args.principal,
                             out=sys.stdout, err=sys.stderr)
    if not check.client.https and not is_loopback_host(check.client.host):
        print("check: warning: the token goes to %s in plain http, readable on the way" % args.url,
              file=sys.stderr, flush=True)
    return 0 if check.run() else 1


# -------------------------------------------------------------------------------------------------
# replicate: copy a principal's feeds and memory to another server
# -------------------------------------------------------------------------------------------------

# A client of the protocol on both sides: it reads no data dir and works between any two servers.
# Feeds are copied page by page from the last cursor the target acknowledged; memory notes are
# reconciled three ways against the source's hashes of the previous pass (the state file's base).
# Read it as: the pure rules (plan_pushes, plan_memory), the state file (ReplicationState), a
# side's requests (ReplicateSide), what is said and counted (ReplicateReport), when a request is
# tried again (RetryPolicy), one feed's copy (FeedCopy), one memory scope's (ScopeCopy), and the
# run that finds what to copy and decides what a fault ends (Replicator).

REPLICATE_TIMEOUT = 60           # seconds for one request; a long-poll gets its wait on top
REPLICATE_WAIT = 30              # a --follow long-poll's wait
REPLICATE_RELIST_SECONDS = 60    # --follow: projects listed again this often
REPLICATE_MEMORY_SECONDS = 60    # --follow: memory scopes looked at this often
REPLICATE_BACKOFF = (1.0, 60.0)  # first and longest wait after a network error or a 5xx
# --follow: a long-poll answered sooner with nothing (a server past its share of parked pulls, or
# one that ignores wait) is made again this long after the previous one began, not at once.
REPLICATE_EMPTY_POLL_SECONDS = 1.0
# Without --follow: tries of one request before its feed or scope gives up.
REPLICATE_ATTEMPTS = 5
# Fresh snapshots after a 409 revision_conflict before a scope gives up.
MEMORY_COMMIT_ATTEMPTS = 5
STATE_VERSION = 1
PROGRESS_SECONDS = 1.0
PUSHES_IN_FLIGHT = 2             # pages of one feed pushed at once (on connections of their own)

# The three-way decisions for one note id.
KEEP, CREATE, UPDATE, DELETE, CONFLICT = "keep", "create", "update", "delete", "conflict"


class ReplicateFatal(Exception):
    """A side refused the token (401, 403): the run ends at once with exit 1, --follow included."""


class ReplicateTransient(Exception):
    """A network error, a 5xx or a 429 from side (a ReplicateSide): worth trying again later."""

    def __init__(self, side, message):
        Exception.__init__(self, message)
        self.side = side


class ReplicateRefused(Exception):
    """Something the target (or the source) refuses for good: that feed or memory scope stops."""


class ReplicateTooLarge(ReplicateRefused):
    """An answer past its byte limit: the same request would bring it again."""


class ReplicateStopped(Exception):
    """A stop came while a request waited to be tried again: what it was part of ends quietly."""


def feed_name(team, project):
    """A feed's name in messages and in the state file: personal/P or team/T/P."""
    return "personal/%s" % project if team is None else "team/%s/%s" % (team, project)


def scope_name(project):
    """A memory scope's name in messages and in the state file: user or project/P."""
    return "user" if project is None else "project/%s" % project


def plan_pushes(events, max_records=MAX_PUSH_RECORDS, max_sessions=MAX_PUSH_SESSIONS,
                max_bytes=MAX_PUSH_BYTES, overhead=0):
    """Split a page into pushes within the target's limits. events: (kind "r" or "s", encoded
    bytes) in push order; overhead: the body's bytes around them. A list of (start, end) ranges of
    events; an event too large even alone gets a push of its own (the target's response
    decides)."""
    ranges, start, records, sessions, size = [], 0, 0, 0, overhead
    for index, (kind, data) in enumerate(events):
        more = len(data) + 1  # and its comma
        full = ((records == max_records if kind == "r" else sessions == max_sessions)
                or size + more > max_bytes)
        if full and index > start:
            ranges.append((start, index))
            start, records, sessions, size = index, 0, 0, overhead
        size += more
        if kind == "r":
            records += 1
        else:
            sessions += 1
    if start < len(events):
        ranges.append((start, len(events)))
    return ranges


def push_body(project, team, events):
    """The bytes of a push of these (kind, encoded event) pairs."""
    head = b'{"project":' + encode_json(project)
    if team is not None:
        head += b',"team":' + encode_json(team)
    return b"%s,\"records\":[%s],\"sessions\":[%s]}" % (
        head, b",".join(data for kind, data in events if kind == "r"),
        b",".join(data for kind, data in events if kind == "s"))


def push_page_body(project, team, records, sessions):
    """The bytes of one push of a whole page, or None when they are past the push limits."""
    if len(records) > MAX_PUSH_RECORDS or len(sessions) > MAX_PUSH_SESSIONS:
        return None
    body = {"project": project, "records": records, "sessions": sessions}
    if team is not None:
        body["team"] = team
    data = encode_json(body)
    return data if len(data) <= MAX_PUSH_BYTES else None


def event_label(kind, event):
    """How an event is named in a message: record SESSION/ID or session ID gen N (ASCII, one
    line)."""
    def shown(value):
        text = json.dumps(value, ensure_ascii=True)
        text = text[1:-1] if isinstance(value, str) else text
        return text if len(text) <= 80 else text[:80] + "..."
    if kind == "r":
        return "record %s/%s" % (shown(event.get("session")), shown(event.get("id")))
    return "session %s gen %s" % (shown(event.get("id")), shown(event.get("gen")))


def note_time(note):
    """When a note was last changed, as far as it says: updatedAt, else createdAt."""
    stamp = note.get("updatedAt")
    return stamp if stamp is not None else note.get("createdAt", 0)


def memory_decision(base, source, target):
    """The three-way decision for one note id. base: the source's hash at the previous pass
    (None: no note then, or no previous pass); source, target: (hash, note) with hash None for a
    tombstone, or None when the id is absent. KEEP and CONFLICT leave the target; CREATE, UPDATE
    and DELETE apply the source."""
    source_hash = source[0] if source is not None else None
    target_hash = target[0] if target is not None else None
    if source_hash == base or source_hash == target_hash:
        # the source did not change (the target's own edits stay), or both already agree
        return KEEP
    if target is None or target_hash == base:
        if source_hash is None:
            return DELETE
        return CREATE if target_hash is None else UPDATE
    if (source_hash is not None and target_hash is not None
            and note_time(source[1]) > note_time(target[1])):
        return UPDATE  # both changed, both live: the later one wins (a tie keeps the target)
    return CONFLICT


def plan_memory(base, source, target):
    """(changes for the target's commit, ids of kept conflicts, {decision: count}) of one scope.
    base: {id: hash or None}; source, target: memory_entries()."""
    changes, conflicts, counts = [], [], {CREATE: 0, UPDATE: 0, DELETE: 0}
    for note_id in sorted(set(source) | set(base)):
        decision = memory_decision(base.get(note_id), source[note_id], target.get(note_id))
        if decision == CONFLICT:
            conflicts.append(note_id)
        elif decision == DELETE:
            changes.append({"id": note_id, "hash": None})
        elif decision != KEEP:
            hash_value, note = source[note_id]  # live: CREATE and UPDATE need a live source note
            if note is None:
                raise ValueError("the source sent note %s without its content" % note_id)
            changes.append({"id": note_id, "hash": hash_value, "note": note})
        if decision in counts:
            counts[decision] += 1
    return changes, conflicts, counts


def new_state(source, target):
    """An empty state document for copies from source to target."""
    return {"version": STATE_VERSION, "from": source, "to": target, "feeds": {}, "memory": {}}


def check_state(doc, source, target):
    """doc when it is a state document for source to target; ValueError saying why not."""
    if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
        raise ValueError("not a replicate state file (version %d)" % STATE_VERSION)
    if doc.get("from") != source or doc.get("to") != target:
        raise ValueError("it is for %s to %s" % (excerpt(doc.get("from"), 100),
                                                 excerpt(doc.get("to"), 100)))
    feeds, memory = doc.get("feeds"), doc.get("memory")
    if (not isinstance(feeds, dict)
            or any(as_safe_int(cursor) is None for cursor in feeds.values())):
        raise ValueError("its feeds are not cursors")
    if not isinstance(memory, dict):
        raise ValueError("its memory is not an object")
    for scope in memory.values():
        if not (isinstance(scope, dict)
                and (scope.get("etag") is None or isinstance(scope.get("etag"), str))
                and isinstance(scope.get("base"), dict)
                and all(h is None or (isinstance(h, str) and _HASH.fullmatch(h))
                        for h in scope["base"].values())):
            raise ValueError("its memory scopes are malformed")
    return doc


class ReplicationState:
    """Cursors and memory bases, in memory and (with --state) in a file written atomically at each
    change. A new file is written at once: one that cannot be is a usage error before anything is
    copied."""

    def __init__(self, path, source, target):
        self.path = path
        self._lock = threading.Lock()
        self.doc = new_state(source, target)
        # the memory part encoded, as it changes far less often than a cursor
        self._memory_json = None
        if path is None:
            return
        try:
            if os.path.exists(path):
                with open(path, "rb") as f:
                    self.doc = check_state(decode_json(f.read()), source, target)
            else:
                self._save()
        except (OSError, ValueError) as exc:
            raise UsageError("cannot use the state file %s: %s" % (path, reason(exc))) from None

    def cursor(self, name):
        """The cursor feed name (FeedRef.name) was copied to, 0 at first."""
        with self._lock:
            return self.doc["feeds"].get(name, 0)

    def set_cursor(self, name, cursor):
        with self._lock:
            self.doc["feeds"][name] = cursor
            self._save()

    def scope_base(self, name):
        """Of memory scope name's previous pass: (True when there was one, the source's etag then,
        {id: the source's hash then})."""
        with self._lock:
            saved = self.doc["memory"].get(name)
            return (True, saved["etag"], dict(saved["base"])) if saved else (False, None, {})

    def set_scope_base(self, name, etag, base):
        with self._lock:
            self.doc["memory"][name] = {"etag": etag, "base": base}
            self._memory_json = None
            self._save()

    def _save(self):
        if self.path is None:
            return
        if self._memory_json is None:
            self._memory_json = encode_json(self.doc["memory"])
        head = dict((name, value) for name, value in self.doc.items() if name != "memory")
        write_atomically(self.path,
                         encode_json(head)[:-1] + b',"memory":' + self._memory_json + b"}")


class Fetch(threading.Thread):
    """function(*args, **kwargs) in a thread of its own (a daemon: a long-poll never holds up an
    exit); result() waits for it and returns its value or raises its exception."""

    def __init__(self, function, *args, **kwargs):
        threading.Thread.__init__(self, daemon=True, name="replicate fetch")
        self.function, self.args, self.kwargs = function, args, kwargs
        self.value = self.error = None
        self.start()

    def run(self):
        try:
            self.value = self.function(*self.args, **self.kwargs)
        except BaseException as exc:  # handed to result(), in the thread that waits for it
            self.error = exc

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


class FeedRef(collections.namedtuple("FeedRef", "team project")):
    """A feed replicate copies: its team (None: the principal's own) and project."""

    __slots__ = ()

    @property
    def name(self):
        return feed_name(self.team, self.project)


class ReplicateSide:
    """One server of a replication: its URL, token, TLS trust and (for memory) principal and quota;
    request() sends it a request and sorts the answer, outage() counts its requests failing."""

    def __init__(self, role, url, token, context, principal=None):
        self.role = role  # "source" or "target", in messages
        self.url = url
        self.token = token
        self.context = context
        self.principal = principal
        self.quota = dict(MEMORY_QUOTA)
        self.flag = "--from" if role == "source" else "--to"
        self._lock = threading.Lock()
        # live: requests failing now (each said once, when the first one began), and since when
        self._failing = 0
        self._failing_since = None

    def client(self):
        return SyncClient(self.url, self.token, self.context, REPLICATE_TIMEOUT)

    def request(self, what, send, statuses=(200,)):
        """(status, document) of send(), a function that sends one request with a client of this
        side (what: "METHOD /path", for messages); ReplicateFatal for 401 and 403,
        ReplicateTransient for a network error (an answer not whole in time included), 429 or
        5xx, ReplicateRefused for an answer past its byte limit and for any other status not in
        statuses."""
        try:
            status, _, document = send()
        except AnswerTooLarge as exc:  # the same answer again would be as large
            raise ReplicateTooLarge("%s: %s" % (self.role, exc)) from None
        except (ConnectFailed, OSError, http.client.HTTPException) as exc:
            error = exc.error if isinstance(exc, ConnectFailed) else exc
            if isinstance(error, ssl.SSLCertVerificationError):  # trying again changes nothing
                raise ReplicateFatal("the %s %s: its certificate cannot be verified (%s); for a "
                                     "self-signed one, give it with --ca-file"
                                     % (self.role, self.url, error.verify_message)) from None
            if isinstance(exc, ConnectFailed):  # its cause in words (connect_failure)
                raise ReplicateTransient(self, "%s: %s: %s" % (self.role, what, exc)) from None
            raise ReplicateTransient(self, "%s: %s of %s: network error: %s" % (
                self.role, what, self.url, str(error) or type(error).__name__)) from None
        code = document.get("code") if isinstance(document, dict) else None
        if status == 403 and code == "account_mismatch":  # the principal expected, not the token
            raise ReplicateFatal(
                "%s-principal %s is not the principal of the %s token: the %s %s answered %s with "
                "403 %s; give %s-principal the principal the token was issued to (or --no-memory)"
                % (self.flag, self.principal, self.flag, self.role, self.url, what,
                   excerpt(document), self.flag))
        if status in (401, 403) and status not in statuses:
            raise ReplicateFatal("the %s %s refuses its token: %s answered %d %s" % (
                self.role, self.url, what, status, excerpt(document)))
        if status == 503 and code == "auth_not_configured":
            raise ReplicateRefused("the %s has memory sync turned off: %s answered %d %s" % (
                self.role, what, status, excerpt(document)))
        if status == 429 or status >= 500:
            raise ReplicateTransient(self, "%s: %s answered %d %s"
                                     % (self.role, what, status, excerpt(document)))
        if status not in statuses:
            raise ReplicateRefused("the %s answered %s with %d %s"
                                   % (self.role, what, status, excerpt(document)))
        return status, document

    def outage(self, change):
        """Count a request that starts failing (change 1) or ends (-1): (True when it is the first
        failing, the seconds the side failed when it is the last, else None)."""
        with self._lock:
            self._failing += change
            began = self._failing == 1 and change > 0
            if began:
                self._failing_since = time.monotonic()
            if self._failing != 0 or self._failing_since is None:
                return began, None
            seconds, self._failing_since = time.monotonic() - self._failing_since, None
            return began, seconds


class ReplicateReport:
    """What a replication says (one line each on out, its tokens hidden) and what it counts."""

    def __init__(self, out, secrets, quiet=False, progress=False):
        self.out = out
        self.secrets = secrets
        self.quiet = quiet
        self.progress = progress and not quiet  # a line per feed, rewritten as it is copied
        self.failed = False
        self.totals = collections.Counter()
        self.scopes = {}        # {memory scope looked at: True once the source had notes there}
        self._lock = threading.Lock()

    def say(self, message, error=False):
        if error or not self.quiet:
            for secret in self.secrets:
                message = message.replace(secret, "<token>")
            with self._lock:
                try:
                    print("replicate: %s" % escaped(message), file=self.out, flush=True)
                except (OSError, ValueError):
                    pass

    def fail(self, message):
        with self._lock:
            self.failed = True
        self.say(message, error=True)

    def count(self, **amounts):
        with self._lock:
            self.totals.update(amounts)

    def scope_seen(self, name, found):
        """A memory scope looked at; found: the source had notes there."""
        with self._lock:
            self.scopes[name] = self.scopes.get(name, False) or found

    def show_progress(self, name, events, seconds, start="", end=""):
        line = "%s: %d events, %d events/s" % (name, events,
                                               events / seconds if seconds > 0 else 0)
        with self._lock:
            try:
                self.out.write("%sreplicate: %-60s%s" % (start, line, end))
                self.out.flush()
            except (OSError, ValueError):
                pass

    def summary(self, seconds):
        t = self.totals
        return ("%s, %s copied, %d already on the target; notes: %d created, %d updated, "
                "%d deleted, %s kept; %.1f s"
                % (plural(t["feeds"], "feed"), plural(t["copied"], "event"), t["had"],
                   t["created"], t["updated"], t["deleted"], plural(t["conflicts"], "conflict"),
                   seconds))

    def memory_summary(self, most=10):
        """The line that names the memory scopes looked at (the first most of them), and says when
        none held a note how a project's scope is found; None when memory was not looked at."""
        with self._lock:
            names, found = list(self.scopes), any(self.scopes.values())
        if not names:
            return None
        shown = ", ".join(names[:most]) + (" and %d more" % (len(names) - most)
                                           if len(names) > most else "")
        if found:
            return "memory: looked at %s: %s" % (plural(len(names), "scope"), shown)
        return ("memory: no notes in the %s looked at (%s); the memory of a project with no "
                "session feed is found only when named with --project ID"
                % (plural(len(names), "scope"), shown))


class RetryPolicy:
    """The one place that decides when a failed request is tried again. A transient fault
    (ReplicateTransient) is waited out, 1 s doubling to 60 s: live (--follow), for ever, a side's
    faults said once when it starts failing and once more when it is back; else each fault is
    said and the request gives up after REPLICATE_ATTEMPTS tries (ReplicateRefused). A stop ends
    the waiting (ReplicateStopped). Any other fault is not retried: Replicator.ended decides
    what it ends."""

    def __init__(self, live, stopping, report):
        self.live = live
        self.stopping = stopping
        self.report = report

    def attempt(self, action, what):
        """action(), and again after transient faults; what: the request, in messages."""
        delay, attempt, failing = REPLICATE_BACKOFF[0], 0, None
        try:
            while True:
                try:
                    return action()
                except ReplicateTransient as exc:
                    attempt += 1
                    if not self.live and attempt >= REPLICATE_ATTEMPTS:
                        raise ReplicateRefused("%s (gave up after %d tries)"
                                               % (exc, attempt)) from None
                    if not self.live:
                        self.report.say("%s: %s; trying again in %g s" % (what, exc, delay),
                                        error=True)
                    elif failing is None:
                        failing = exc.side
                        self.outage(failing, 1, "%s: %s" % (what, exc))
                    if self.stopping.wait(delay):
                        raise ReplicateStopped() from None
                    delay = min(delay * 2, REPLICATE_BACKOFF[1])
        finally:
            if failing is not None:
                self.outage(failing, -1)

    def outage(self, side, change, fault=None):
        """A request of side's starts failing (change 1, fault: the first error) or ends (-1):
        the first says the side is failing, the last that it is back."""
        began, seconds = side.outage(change)
        if began:
            self.report.say("the %s %s is failing: %s; trying again (after %g s, doubling up to "
                            "%g s) until it is back, which is said"
                            % ((side.role, side.url, fault) + tuple(REPLICATE_BACKOFF)),
                            error=True)
        elif seconds is not None and not self.stopping.is_set():
            self.report.say("the %s %s is back, after %.0f s" % (side.role, side.url, seconds),
                            error=True)


class FeedCopy:
    """The copy of one feed from its cursor in the state to the end (live: and then as events
    arrive). The next page is pulled while pages are pushed, PUSHES_IN_FLIGHT at once, and the
    state is written for each page once it and every page before it were acknowledged."""

    def __init__(self, replicator, feed):
        self.replicator = replicator
        self.feed = feed  # a FeedRef
        self.name = feed.name
        self.retry = replicator.retry
        self.limit = MAX_PULL_LIMIT  # events a pull asks for: halved for good past the limit
        self.pushing = collections.deque()  # (a page's push, the cursor after it), oldest first
        self.saving = None  # the last state write, made while later pages are pushed
        self.copied = 0

    def run(self):
        """Copy; a fault ends the copy as Replicator.ended says (a ReplicateFatal is raised)."""
        replicator, report = self.replicator, self.replicator.report
        live, stopping = self.retry.live, replicator.stopping
        source = replicator.source.client()
        targets = [replicator.target.client() for _ in range(PUSHES_IN_FLIGHT)]
        cursor = replicator.state.cursor(self.name)  # after the last page pulled
        started = shown = time.monotonic()
        try:
            fetch, turn = Fetch(self.pull, source, cursor, 0), 0
            while True:
                next_cursor, records, sessions, more, body = fetch.result()
                fetch = (Fetch(self.pull, source, next_cursor, 0)
                         if more and not stopping.is_set() else None)
                if next_cursor != cursor:
                    if not replicator.begin_work():
                        break
                    push = Fetch(self.push_in_flight, targets[turn % len(targets)], records,
                                 sessions=sessions, body=body)
                    self.pushing.append((push, next_cursor))
                    cursor, turn = next_cursor, turn + 1
                self.settle(len(targets) - 1 if fetch is not None else 0)
                if report.progress and not live and time.monotonic() - shown >= PROGRESS_SECONDS:
                    shown = time.monotonic()
                    report.show_progress(self.name, self.copied, shown - started, "\r")
                if fetch is None:
                    if not live or stopping.is_set():
                        break
                    fetch = Fetch(self.pull, source, cursor, REPLICATE_WAIT)  # a long-poll
            self.settle(0)
            if self.saving is not None:
                self.saving.result()
        except (ReplicateRefused, ReplicateStopped, OSError) as exc:
            replicator.ended(exc, self.name, "this feed stops")
            return
        finally:
            # a later page's push, when an earlier one was refused: not recorded
            for push, _ in self.pushing:
                push.join(REPLICATE_TIMEOUT)
                if push.error is None and not push.is_alive():
                    replicator.end_work()
            source.close()
            for target in targets:
                target.close()
        if report.progress and not live:
            report.show_progress(self.name, self.copied, time.monotonic() - started, "\r",
                                 end="\n")

    def pull(self, client, since, wait):
        """The page after since (wait: a long-poll's) as pull_page() has it, and its push body,
        made here too: it overlaps the pushes. A page past the answer limit (a server whose pages
        are not bounded in bytes) is asked again for half as many events, down to one."""
        started = time.monotonic()
        while True:
            try:
                page = self.retry.attempt(lambda: self.pull_page(client, since, wait),
                                          "%s: pull" % self.name)
                break
            except ReplicateTooLarge:
                if self.limit == 1:
                    raise
                self.limit //= 2
                self.replicator.report.say("%s: a page passed %s: pulling %d events at a time" % (
                    self.name, format_bytes(LARGE_ANSWER_BYTES), self.limit))
        if wait and not (page[1] or page[2]):
            self.replicator.stopping.wait(
                REPLICATE_EMPTY_POLL_SECONDS - (time.monotonic() - started))
        return page + (push_page_body(self.feed.project, self.feed.team, page[1], page[2]),)

    def pull_page(self, client, since, wait):
        """(cursor, records, sessions, more) of one pull of at most self.limit events;
        ReplicateRefused when malformed."""
        params = {"limit": self.limit}
        if wait:
            params["wait"] = wait
        source = self.replicator.source
        _, document = source.request("GET /v1/pull", lambda: client.pull(
            self.feed.project, since, team=self.feed.team, keep_alive=True, **params))
        return Replicator.checked(source, pull_page, document, since)

    def settle(self, keep):
        """Wait for pushes until at most keep are in flight; write each one's cursor, in order
        (the work begun for a push ends once its cursor is written: a stop waits for that
        too)."""
        while len(self.pushing) > keep:
            push, after = self.pushing[0]
            self.copied += push.result()
            if self.saving is not None:
                self.saving.result()
            self.pushing.popleft()
            self.saving = Fetch(self.save_cursor, after)

    def push_in_flight(self, client, records, sessions, body):
        """push_page() of a page in a thread of its own; the work begun for it ends here when it
        fails, else once its cursor is written (save_cursor)."""
        try:
            return self.push_page(client, records, sessions, body) if records or sessions else 0
        except BaseException:
            self.replicator.end_work()
            raise

    def save_cursor(self, cursor):
        try:
            self.replicator.state.set_cursor(self.name, cursor)
        finally:
            self.replicator.end_work()

    def push_page(self, client, records, sessions, data):
        """Push a page's events in pushes within the limits; how many events were sent.
        data: push_page_body(); a page that fits is pushed whole, else (or when refused) event by
        event."""
        if (data is not None
                and self.push(client, data, events=len(records) + len(sessions))[0] == 200):
            return len(records) + len(sessions)
        events = ([("r", encode_json(e), e) for e in records]
                  + [("s", encode_json(e), e) for e in sessions])
        overhead = len(push_body(self.feed.project, self.feed.team, []))
        for start, end in plan_pushes([(kind, data) for kind, data, _ in events],
                                      overhead=overhead):
            self.push_events(client, events[start:end])
        return len(events)

    def push_events(self, client, events):
        """Push events; a 400 or 413 halves them and tries again, down to one event the target
        refuses."""
        body = push_body(self.feed.project, self.feed.team,
                         [(kind, data) for kind, data, _ in events])
        status, doc = self.push(client, body, events=len(events))
        if status == 200:
            return
        if len(events) == 1:
            kind, _, event = events[0]
            raise ReplicateRefused("the target refuses %s even alone: %d %s" % (
                event_label(kind, event), status, excerpt(doc)))
        half = len(events) // 2
        self.push_events(client, events[:half])
        self.push_events(client, events[half:])

    def push(self, client, body, events):
        """One push of body, which holds this many events: (status, document); 200, 400 or 413.
        What a 200 says is counted: events copied, and events the target already had."""
        target = self.replicator.target
        status, document = self.retry.attempt(
            lambda: target.request("POST /v1/push", lambda: client.push(body, keep_alive=True),
                                   statuses=(200, 400, 413)),
            "%s: push" % self.name)
        if status == 200:
            accepted = Replicator.checked(target, push_counts, document)[1]
            if accepted > events:
                raise ReplicateRefused("the target answered a push with %s" % excerpt(document))
            self.replicator.report.count(copied=accepted, had=events - accepted)
        return status, document


class ScopeCopy:
    """The reconciliation of one memory scope (project None: the user scope) on the clients
    given: both sides' snapshots, the three-way plan against the base of the previous pass, the
    target's commits and the new base in the state. A commit another client's beat (409
    revision_conflict) looks again, MEMORY_COMMIT_ATTEMPTS times at most."""

    def __init__(self, replicator, project, source, target):
        self.replicator = replicator
        self.project = project
        self.name = scope_name(project)
        self.source = source
        self.target = target

    def run(self):
        """Reconcile; a fault ends the copy as Replicator.ended says (a ReplicateFatal is
        raised)."""
        try:
            self.reconcile()
        except (ReplicateRefused, ReplicateStopped, OSError) as exc:
            self.replicator.ended(exc, "memory " + self.name, "this scope stops")

    def reconcile(self):
        replicator, name = self.replicator, self.name
        known, known_etag, base = replicator.state.scope_base(name)
        for _ in range(MEMORY_COMMIT_ATTEMPTS):
            fields = {"project": self.project,
                      "have": {i: h for i, h in base.items() if h is not None}}
            if known:
                fields["knownEtag"] = known_etag
            _, theirs = replicator.memory_call(replicator.source, self.source, "snapshot", fields,
                                               retry=replicator.retry)
            # unchanged: there were notes at the previous pass
            replicator.report.scope_seen(
                name, theirs.get("unchanged") is True or bool(base or theirs["_entries"]))
            if theirs.get("unchanged") is True:
                return  # the source did not change since the previous pass: nothing to do
            entries = theirs["_entries"]
            have = {i: h for i, h in base.items() if h is not None}
            have.update((i, h) for i, (h, _) in entries.items() if h is not None)
            _, ours = replicator.memory_call(replicator.target, self.target, "snapshot",
                                             {"project": self.project, "have": have},
                                             retry=replicator.retry)
            current = ours["_entries"]
            changes, conflicts, counts = plan_memory(base, entries, current)
            if not self.commit(ours.get("etag"), changes, current):
                continue  # 409: someone else committed on the target meanwhile; look again
            for note_id in conflicts:
                replicator.report.say("memory %s: note %s changed on both sides; the target's "
                                      "version is kept" % (name, note_id), error=True)
            replicator.report.count(created=counts[CREATE], updated=counts[UPDATE],
                                    deleted=counts[DELETE], conflicts=len(conflicts))
            replicator.state.set_scope_base(name, theirs.get("etag"),
                                            {i: h for i, (h, _) in entries.items()})
            return
        raise ReplicateRefused("the target's memory kept changing (%d tries)"
                               % MEMORY_COMMIT_ATTEMPTS)

    def commit(self, etag, changes, current):
        """Commit changes in chunks of the target's maxChanges; False on 409 revision_conflict."""
        replicator = self.replicator
        step = (as_safe_int(replicator.target.quota.get("maxChanges"))
                or MEMORY_QUOTA["maxChanges"])
        have = {i: h for i, (h, _) in current.items() if h is not None}
        for start in range(0, len(changes), step):
            chunk = changes[start:start + step]
            for change in chunk:
                if change["hash"] is None:
                    have.pop(change["id"], None)
                else:
                    have[change["id"]] = change["hash"]
            if not replicator.begin_work():
                raise ReplicateStopped()
            try:
                status, doc = replicator.memory_call(
                    replicator.target, self.target, "commit",
                    {"project": self.project, "etag": etag, "changes": chunk, "have": have},
                    retry=replicator.retry, statuses=(200, 409, 413, 400))
            finally:
                replicator.end_work()
            if status == 409 and doc.get("code") == "revision_conflict":
                return False
            if status != 200:
                raise ReplicateRefused("the target refused a commit: %d %s"
                                       % (status, excerpt(doc)))
            etag = doc.get("etag")
        return True


# What ends a feed's or a scope's copy, or a whole run, as Replicator.ended decides.
REPLICATE_FAULTS = (ReplicateFatal, ReplicateRefused, ReplicateStopped, OSError)


class Replicator:
    """Copies a principal's feeds (personal and teams) and memory notes from a source to a target
    server, once (run) or continuously (follow): finds what to copy, copies each feed (FeedCopy)
    and memory scope (ScopeCopy), and decides what each fault ends (ended). Messages and counts
    are self.report's."""

    def __init__(self, source, target, state, teams=(), projects=(), memory=True, quiet=False,
                 out=None, progress=False):
        self.source = source
        self.target = target
        self.state = state
        self.namespaces = [None] + list(teams)
        self.projects = list(projects)
        self.with_memory = memory
        self.report = ReplicateReport(out or sys.stderr, (source.token, target.token),
                                      quiet=quiet, progress=progress)
        self.stopping = threading.Event()
        self.retry = RetryPolicy(False, self.stopping, self.report)  # follow() makes it live
        self.fatal = None       # the line a 401 or 403 ends the run with, said last
        self._lock = threading.Lock()
        self._busy = 0          # pushes and commits in flight: a stop lets them finish
        self._idle = threading.Condition(self._lock)

    @staticmethod
    def checked(side, check, *args):
        """check(*args), a check of the shape of a response from side; ReplicateRefused for a
        BadResponse."""
        try:
            return check(*args)
        except BadResponse as exc:
            raise ReplicateRefused("%s: %s" % (side.role, exc)) from None

    def ended(self, exc, part=None, stops=None):
        """Say what exc ends: the one place a fault that is not retried is decided. part: the
        feed or scope it ended the copy of, for messages (None: the run); stops: what a refusal
        stops, said after it. ReplicateStopped ends its part quietly (a stop came), and
        ReplicateRefused its part; a side that refuses its token (ReplicateFatal, said last,
        once), the state file that cannot be written (an OSError: what is copied could not be
        remembered) and any other exception (a bug: one line, never a traceback) end the run."""
        if isinstance(exc, ReplicateStopped):
            return
        if isinstance(exc, ReplicateRefused):
            self.report.fail("".join((part + ": " if part else "", str(exc),
                                      "; " + stops if stops else "")))
            return
        if isinstance(exc, ReplicateFatal):
            with self._lock:
                self.fatal = self.fatal or str(exc)
        elif isinstance(exc, OSError):
            self.report.fail("stopped: cannot write the state file %s: %s"
                             % (self.state.path, reason(exc)))
        else:
            self.report.fail("%sstopped by an unexpected error: %s: %s" % (
                part + ": " if part else "", type(exc).__name__, exc))
        self.stopping.set()

    # -- work in flight ------------------------------------------------------------

    def begin_work(self):
        """False once stopping; else a push (and the state write after it) or a commit may start
        (end_work() when it is done)."""
        with self._lock:
            if self.stopping.is_set():
                return False
            self._busy += 1
            return True

    def end_work(self):
        with self._lock:
            self._busy -= 1
            self._idle.notify_all()

    def stop(self, seconds=120):
        """Stop: no new push or commit starts; wait for those in flight (their state is
        written)."""
        self.stopping.set()
        with self._lock:
            self._idle.wait_for(lambda: self._busy == 0, seconds)

    # -- what to copy --------------------------------------------------------------

    def listed_feeds(self):
        """[FeedRef] of every feed to copy: the given projects, or the source's list."""
        found = []
        client = self.source.client()
        try:
            for team in self.namespaces:
                if self.projects:
                    found += [FeedRef(team, project) for project in self.projects]
                    continue
                document = self.retry.attempt(
                    lambda: self.source.request("GET /v1/projects", lambda: client.projects(
                        team=team, keep_alive=True))[1],
                    "listing the projects of %s" % ("team " + team if team else "personal feeds"))
                projects = self.checked(self.source, project_ids, document)
                found += [FeedRef(team, project) for project in projects]
        finally:
            client.close()
        return found

    # -- memory ----------------------------------------------------------------------

    def memory_identities(self):
        """Confirm each side's principal with /v1/memory/identity, and take the target's quota.
        False (said why) when memory cannot be copied."""
        try:
            for side in (self.source, self.target):
                self.memory_identity(side)
        except ReplicateRefused as exc:
            self.ended(exc, "memory", "no memory is copied")
            return False
        return True

    def memory_identity(self, side):
        client, body = side.client(), {"expectedPrincipal": side.principal}
        try:
            _, document = self.retry.attempt(
                lambda: side.request("POST /v1/memory/identity", lambda: client.post_memory(
                    "identity", body, keep_alive=True)),
                "%s memory identity" % side.role)
        finally:
            client.close()
        self.checked(side, check_principal, document, side.principal)
        quota = document.get("quota")
        if isinstance(quota, dict) and as_safe_int(quota.get("maxChanges")):
            side.quota = quota

    def copy_memory(self, projects):
        """Reconcile the memory scope of each project (None: the user scope), on one client a
        side."""
        source, target = self.source.client(), self.target.client()
        try:
            for project in projects:
                if self.stopping.is_set():
                    break
                ScopeCopy(self, project, source, target).run()
        finally:
            source.close()
            target.close()

    def memory_call(self, side, client, route, fields, retry, statuses=(200,)):
        """(status, document) of a memory request of side's for fields' scope, its faults tried
        again as retry says; a snapshot's or commit's entries checked, as document["_entries"]."""
        body = dict(fields, expectedPrincipal=side.principal)
        if fields.get("project") is None:
            body.pop("project", None)
            body["scope"] = "user"
        status, document = retry.attempt(
            lambda: side.request("POST /v1/memory/" + route,
                                 lambda: client.post_memory(route, body, keep_alive=True),
                                 statuses=statuses),
            "%s memory %s" % (side.role, route))
        if status == 200 and not (isinstance(document, dict) and "unchanged" in document):
            document["_entries"] = self.checked(side, memory_entries, document)
        return status, document

    # -- the runs --------------------------------------------------------------------

    def run(self):
        """One pass over every feed and scope. Exit code: 0, or 1 when something could not be
        copied."""
        try:
            copy_notes = self.with_memory and self.memory_identities()
            feeds = self.listed_feeds()
            for feed in feeds:
                if self.stopping.is_set():
                    break
                FeedCopy(self, feed).run()
                self.report.count(feeds=1)
            if copy_notes:
                self.copy_memory([None] + sorted(set(feed.project for feed in feeds)))
        except REPLICATE_FAULTS as exc:
            self.ended(exc)
        return self.finish()

    def follow(self):
        """Copy, then keep the target current until stop(): a thread per feed long-polls the
        source; this one lists projects and looks at memory every minute. Exit code as run()."""
        self.retry = RetryPolicy(True, self.stopping, self.report)
        threads, projects = {}, set()
        next_list = next_memory = 0.0
        try:
            copy_notes = self.with_memory and self.memory_identities()
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_list:
                    for feed in self.listed_feeds():
                        if feed not in threads and not self.stopping.is_set():
                            threads[feed] = threading.Thread(
                                target=self.follow_feed, args=(feed,), daemon=True,
                                name="replicate %s" % feed.name)
                            threads[feed].start()
                            self.report.count(feeds=1)
                            projects.add(feed.project)
                    next_list = now + REPLICATE_RELIST_SECONDS
                if copy_notes and now >= next_memory:
                    self.copy_memory([None] + sorted(projects))
                    next_memory = now + REPLICATE_MEMORY_SECONDS
                wake = min(next_list, next_memory) if copy_notes else next_list
                self.stopping.wait(max(0.0, wake - time.monotonic()))
        except REPLICATE_FAULTS as exc:
            self.ended(exc)
        return self.finish()

    def follow_feed(self, feed):
        """A --follow thread's copy of feed; what ends it ends the run."""
        try:
            FeedCopy(self, feed).run()
        except Exception as exc:  # a side refusing its token, or a bug: the run ends
            self.ended(exc, feed.name)

    def finish(self):
        """Let the work in flight end, say the line that ended the run (if any); the exit code."""
        self.stop()
        if self.fatal:
            self.report.fail(self.fatal)
        return 1 if self.report.failed else 0


def token_principal(token):
    """The principal a JWT names in sub (unverified: the server checks it), or None."""
    try:
        payload = decode_jwt(token)[1]
    except AuthError:
        return None
    return payload.get("sub") if is_valid_id(payload.get("sub")) else None


def replicate_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py replicate",
                            description="Copy a principal's session feeds and memory notes from "
                                        "one sync server to another, once or (--follow) as a live "
                                        "mirror.")
    parser.add_argument("--from", dest="source", required=True, metavar="URL",
                        help="the server copied from")
    parser.add_argument("--from-token-file", required=True, metavar="FILE",
                        help="its token, on the first line")
    parser.add_argument("--to", dest="target", required=True, metavar="URL",
                        help="the server copied to")
    parser.add_argument("--to-token-file", required=True, metavar="FILE",
                        help="its token, on the first line")
    parser.add_argument("--team", action="append", default=[], metavar="ID",
                        help="copy this team's feeds too")
    parser.add_argument("--project", action="append", default=[], metavar="ID",
                        help="copy only these projects "
                             "(default: every project the source lists)")
    parser.add_argument("--no-memory", action="store_true", help="copy session feeds only")
    parser.add_argument("--from-principal", metavar="ID",
                        help="the --from token's principal, for memory "
                             "(default: the sub of a JWT)")
    parser.add_argument("--to-principal", metavar="ID",
                        help="the --to token's principal, for memory "
                             "(default: the sub of a JWT)")
    parser.add_argument("--follow", action="store_true",
                        help="keep running, copying as events arrive")
    parser.add_argument("--state", metavar="FILE", help="remember what was copied here, to resume")
    parser.add_argument("--ca-file", metavar="FILE",
                        help="trust the certificates in this file for https")
    parser.add_argument("--allow-plain-http", action="store_true",
                        help="allow http:// to a host other than a loopback address "
                             "(127.0.0.0/8, ::1, localhost): tokens cross the network in clear")
    parser.add_argument("--quiet", action="store_true", help="print errors only")
    args = parser.parse_args(argv)
    ends = []
    for flag, url in (("--from", args.source), ("--to", args.target)):
        https, host, port = parse_base_url(url, flag)
        if not https and not is_loopback_host(host) and not args.allow_plain_http:
            raise UsageError("%s is plain http to %s, not a loopback address: the token would "
                             "cross the network in clear (use https, or --allow-plain-http)"
                             % (flag, host))
        ends.append(("https" if https else "http", host.lower(), port))
    if ends[0][1:] == ends[1][1:]:
        raise UsageError("--from and --to name the same server")
    if server_addresses(*ends[0][1:]) & server_addresses(*ends[1][1:]):
        raise UsageError("--from and --to name the same server (%s port %d and %s port %d are "
                         "one address and port)" % (ends[0][1:] + ends[1][1:]))
    for flag, ids in (("--team", args.team), ("--project", args.project),
                      ("--from-principal",
                       [args.from_principal] if args.from_principal is not None else []),
                      ("--to-principal",
                       [args.to_principal] if args.to_principal is not None else [])):
        for value in ids:
            if not is_valid_id(value):
                raise UsageError("%s must be an id ([A-Za-z0-9_-], 1 to 128 characters)" % flag)
    context = None
    if args.ca_file:
        try:
            context = ssl.create_default_context(cafile=args.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError("cannot use --ca-file %s: %s" % (args.ca_file, reason(exc))) from None
    source_token = read_token_file(args.from_token_file, "--from-token-file")
    target_token = read_token_file(args.to_token_file, "--to-token-file")
    principals = [args.from_principal or token_principal(source_token),
                  args.to_principal or token_principal(target_token)]
    if not args.no_memory:
        for flag, principal in (("--from-principal", principals[0]),
                                ("--to-principal", principals[1])):
            if principal is None:
                raise UsageError("memory needs the principal of the %s token, which is not a "
                                 "JWT: give %s ID, or --no-memory"
                                 % (flag[:-len("-principal")], flag))
    source_url, target_url = ("%s://%s:%d" % end for end in ends)
    state = ReplicationState(args.state, source_url, target_url)
    replicator = Replicator(ReplicateSide("source", args.source.rstrip("/"), source_token, context,
                                          principal=principals[0]),
                            ReplicateSide("target", args.target.rstrip("/"), target_token, context,
                                          principal=principals[1]),
                            state, args.team, projects=args.project, memory=not args.no_memory,
                            quiet=args.quiet, out=sys.stderr, progress=sys.stderr.isatty())
    handlers = {}
    # a test may run this in another thread
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            handlers[signum] = signal.signal(signum, lambda *_: replicator.stopping.set())
    started = time.monotonic()
    try:
        code = replicator.follow() if args.follow else replicator.run()
    except Exception as exc:  # a bug: one line, never a traceback
        replicator.ended(exc)
        code = 1
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if not args.quiet:
        report = replicator.report
        print("replicate: %s" % report.summary(time.monotonic() - started), file=sys.stdout,
              flush=True)
        if report.memory_summary():
            print("replicate: %s" % report.memory_summary(), file=sys.stdout, flush=True)
    return code


# -------------------------------------------------------------------------------------------------
# usage: what each owner stores
# -------------------------------------------------------------------------------------------------

def print_on_stderr(line):
    print(line, file=sys.stderr, flush=True)


def feed_usage(owner, project, entry, now_ms, retain_ms):
    """What one feed file holds, as usage reports it (a damaged feed: with its problem)."""
    kind, owner_id = owner
    stat = entry.stat()
    row = {"owner": owner_id, "team": kind == "t", "project": project, "bytes": stat.st_size,
           "lastEvent": int(stat.st_mtime * 1000)}
    try:
        summary = summarize_feed(entry.path, torn_tail=True)
        kept, erased = plan_compaction(summary, now_ms, retain_ms).outcome(entry.path)
    except (OSError, ValueError) as exc:
        row["problem"] = str(reason(exc))  # (a ValueError is no JSON)
        return row
    deleted = sum(1 for winner in summary.winners.values() if winner[2])
    row.update(events=summary.events, records=summary.records, recordsToErase=erased,
               sessions=len(summary.winners) - deleted, deletedSessions=deleted,
               keptBytes=kept + row["bytes"] - summary.size)
    return row


def scope_usage(principal, scope, files):
    """What one memory scope holds, as usage reports it."""
    row = {"principal": principal, "scope": scope_name(scope.project), "notes": 0, "tombstones": 0,
           "bytes": 0}
    try:
        with open_data_file(files.manifest) as f:
            data = f.read()
        manifest = Manifest.from_bytes(data)
        row["bytes"] += len(data)
    except FileNotFoundError:
        manifest = NO_MANIFEST
    except (OSError, ValueError) as exc:
        row["problem"] = str(reason(exc))
        return row
    row["notes"] = manifest.live_count
    row["tombstones"] = len(manifest.entries) - manifest.live_count
    try:
        row["bytes"] += sum(os.lstat(os.path.join(files.objects, name)).st_size
                            for name in list_data_dir(files.objects))
    except FileNotFoundError:
        pass
    except OSError as exc:
        row["problem"] = "%s: %s" % (files.objects, reason(exc))
    return row


def principal_usage(feeds, scopes, quotas=None):
    """What each principal stores (their own feeds and memory) beside their quota: rows sorted by
    principal, the principals file's (quotas: principal -> bytes or None) with nothing stored
    too; served says whether the server lets them in."""
    stored = dict.fromkeys(quotas or (), 0)
    for row in feeds:
        if not row["team"]:
            stored[row["owner"]] = stored.get(row["owner"], 0) + row["bytes"]
    for row in scopes:
        stored[row["principal"]] = stored.get(row["principal"], 0) + row["bytes"]
    return [{"principal": principal, "bytes": stored[principal],
             "quota": (quotas or {}).get(principal),
             "served": quotas is None or principal in quotas} for principal in sorted(stored)]


def usage_report(data_dir, now_ms, retain_ms, quotas=None):
    """Everything usage says of a data dir, as one JSON-ready document (quotas: the principals
    file's, or None)."""
    layout = DataDir(data_dir)
    feeds = [feed_usage(owner, project, entry, now_ms=now_ms, retain_ms=retain_ms)
             for owner, project, entry in layout.all_feeds() if owner is not None]
    scopes = [scope_usage(principal, scope, files)
              for principal, scope, files in layout.all_scopes()]
    totals = {name: sum(row.get(name, 0) for row in feeds)
              for name in ("events", "records", "recordsToErase", "sessions", "deletedSessions",
                           "bytes", "keptBytes")}
    totals.update(feeds=len(feeds), scopes=len(scopes),
                  notes=sum(row["notes"] for row in scopes),
                  tombstones=sum(row["tombstones"] for row in scopes),
                  memoryBytes=sum(row["bytes"] for row in scopes))
    return {"dataDir": data_dir, "retainDeletedDays": retain_ms // DAY_MS, "feeds": feeds,
            "memory": scopes, "principals": principal_usage(feeds, scopes, quotas),
            "totals": totals, "diskFreeBytes": shutil.disk_usage(data_dir).free}


def format_time(ms):
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ms / 1000.0))


def usage_table(report):
    """The report as text a person reads: columns as wide as their longest name (24 at least)."""
    owners = [("team " if row["team"] else "") + row["owner"] for row in report["feeds"]]
    wide = max([24] + [len(name) for name in owners]
               + [len(row["principal"]) for row in report["memory"] + report["principals"]])
    wide_too = max([24] + [len(row["project"]) for row in report["feeds"]]
                   + [len(row["scope"]) for row in report["memory"]])

    def names(first, second):
        return "  %-*s %-*s " % (wide, first, wide_too, second)

    lines = ["feeds of %s (a compaction keeps what a deletion of %d days or more leaves):"
             % (report["dataDir"], report["retainDeletedDays"]),
             names("owner", "project") + "%9s %9s %13s %10s %10s  %s"
             % ("events", "records", "sessions", "on disk", "kept", "last event")]
    for owner, row in zip(owners, report["feeds"]):
        if "problem" in row:
            lines.append(names(owner, row["project"]) + row["problem"])
            continue
        lines.append(names(owner, row["project"]) + "%9d %9d %6d+%-6d %10s %10s  %s" % (
            row["events"], row["records"], row["sessions"], row["deletedSessions"],
            format_bytes(row["bytes"]), format_bytes(row["keptBytes"]),
            format_time(row["lastEvent"])))
    lines.append("  (sessions: live+deleted)")
    lines.append("memory:")
    lines.append(names("principal", "scope") + "%9s %11s %10s" % ("notes", "tombstones",
                                                                  "on disk"))
    for row in report["memory"]:
        if "problem" in row:
            lines.append(names(row["principal"], row["scope"]) + row["problem"])
            continue
        lines.append(names(row["principal"], row["scope"]) + "%9d %11d %10s"
                     % (row["notes"], row["tombstones"], format_bytes(row["bytes"])))
    lines.append("principals (their own feeds and memory; a team's feeds count against no one):")
    lines.append("  %-*s %10s %12s" % (wide, "principal", "stored", "quota"))
    for row in report["principals"]:
        quota = ("not listed" if not row["served"] else "-" if row["quota"] is None
                 else format_size(row["quota"]))
        lines.append("  %-*s %10s %12s" % (wide, row["principal"], format_bytes(row["bytes"]),
                                           quota))
    totals = report["totals"]
    lines.append("in all: %s with %s, %s on disk, %s after a compaction; %s with %s, %s; the "
                 "disk has %s free" % (
                     plural(totals["feeds"], "feed"), plural(totals["events"], "event"),
                     format_bytes(totals["bytes"]), format_bytes(totals["keptBytes"]),
                     plural(totals["scopes"], "memory scope"), plural(totals["notes"], "note"),
                     format_bytes(totals["memoryBytes"]), format_bytes(report["diskFreeBytes"])))
    return lines


def usage_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py usage",
                            description="Show what each owner stores in a data dir (read-only: "
                                        "safe while a server runs on it).")
    data_dir_flag(parser)
    parser.add_argument("--json", action="store_true", help="print JSON, for scripts")
    retain_flag(parser)
    parser.add_argument("--principals-file", metavar="FILE",
                        help="the server's --principals-file: each principal's quota beside what "
                             "they store")
    args = parser.parse_args(argv)
    retain_ms = check_retain(args.retain_deleted_days)
    principals = principals_from_flag(args.principals_file)
    data_dir, _ = open_data_dir(args.data, print_on_stderr, write=False)
    report = usage_report(data_dir, int(time.time() * 1000), retain_ms,
                          quotas=principals and principals.quotas)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print("\n".join(usage_table(report)))
    return 0


# -------------------------------------------------------------------------------------------------
# compact: every feed, now
# -------------------------------------------------------------------------------------------------

def compact_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py compact",
                            description="Compact every feed of a data dir now, keeping every "
                                        "event number (the server stopped).")
    data_dir_flag(parser)
    retain_flag(parser)
    args = parser.parse_args(argv)
    retain_ms = check_retain(args.retain_deleted_days)
    data_dir, _ = open_data_dir(args.data, print_on_stderr)
    lock = DataDirLock(data_dir, tool="compact")
    lock.acquire()
    failed, freed, compacted, unchanged = 0, 0, 0, 0
    try:
        lock.change()
        now_ms = int(time.time() * 1000)
        for owner, project, entry in DataDir(data_dir).all_feeds():
            if owner is None:
                continue
            size = entry.stat().st_size
            if shutil.disk_usage(data_dir).free < size + COMPACT_MIN_BYTES:
                print("compact: %s: left as it is: the disk has no room for its new file"
                      % entry.path, flush=True)
                failed += 1
                continue
            try:
                before, after, erased = compact_file(entry.path, now_ms, retain_ms)
            except (OSError, ValueError) as exc:
                print("compact: %s: left as it is: %s (fsck --repair mends a damaged line)"
                      % (entry.path, reason(exc)), flush=True)
                failed += 1
                continue
            if before == after and not erased:  # a line for each such feed would bury the rest
                unchanged += 1
                continue
            compacted += 1
            freed += before - after
            print("compact: %s: %s -> %s, %s freed, %s erased" % (
                entry.path, format_bytes(before), format_bytes(after),
                format_bytes(before - after), plural(erased, "record")), flush=True)
    finally:
        lock.release()
    summary = "compact: %s freed" % format_bytes(freed)
    if compacted:
        summary += " in %s" % plural(compacted, "feed")
    if unchanged:
        summary += "; %s with nothing to drop" % plural(unchanged, "feed")
    if failed:
        summary += "; %s left as %s" % (plural(failed, "feed"),
                                        "it was" if failed == 1 else "they were")
    print(summary)
    return 1 if failed else 0


# -------------------------------------------------------------------------------------------------
# purge: erase a principal
# -------------------------------------------------------------------------------------------------

def purge_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py purge",
                            description="Erase a principal: revoke their tokens, remove their own "
                                        "feeds and memory (team feeds stay). The server stopped.")
    data_dir_flag(parser)
    parser.add_argument("--principal", required=True, metavar="ID")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would go, and change nothing")
    args = parser.parse_args(argv)
    if not is_valid_id(args.principal):
        raise UsageError("--principal must be an id ([A-Za-z0-9_-], 1 to 128 characters)")
    data_dir, _ = open_data_dir(args.data, print_on_stderr, write=not args.dry_run)
    lock = DataDirLock(data_dir, tool="purge")
    try:
        lock.acquire()
    except UsageError:
        if not args.dry_run:
            raise
        lock = None  # a dry run only reads, as usage does: a server may run meanwhile
    try:
        return purge(DataDir(data_dir), args.principal, args.dry_run, lock)
    finally:
        if lock is not None:
            lock.release()


def erase_dir(path, aside):
    """Remove the directory path and all it holds (and its name file, path.id), durably, whole or
    not at all: it is renamed to aside in one step and the parent fsynced before what it holds is
    removed; a crash before the end leaves aside, which purge finishes."""
    parent = os.path.dirname(path)
    if os.path.isdir(aside):  # (an interrupted purge's, before the name was used again)
        remove_tree(aside)
    if os.path.isdir(path):
        os.rename(path, aside)
        sync_dir(parent)
    if _remove(path + ".id"):  # (after: should this be lost, the directory is gone already)
        sync_dir(parent)
    if os.path.isdir(aside):
        remove_tree(aside)


def purge(layout, principal, dry_run, lock):
    """Erase principal from the data dir at layout (or with dry_run, say what would go); lock: the
    DataDirLock held (a tool's), None on a dry run while a server holds the dir."""
    tokens = TokenStore(layout.path)
    try:
        records = [record for record in tokens.read() if record["principal"] == principal]
        purged = read_purged(layout)
    except (OSError, ValueError) as exc:
        raise UsageError("cannot read %s: %s" % (layout.path, reason(exc))) from None
    owner = ("u", principal)
    theirs = (layout.owner_dir(owner), layout.memory_dir(principal))
    for path in layout.links():
        if (path in (layout.feeds, layout.memory) + theirs
                or path.startswith(tuple(top + os.sep for top in theirs))):
            raise UsageError("%s is a link: purge removes nothing through a link, and changed "
                             "nothing (fsck --repair removes the link, never its target)" % path)
    feeds = sorted(layout.owner_feeds(owner), key=lambda item: item[0])
    scopes = [(scope, files) for who, scope, files in layout.all_scopes() if who == principal]
    # Their directories (what is in them goes whole: each is moved aside at once), and what a
    # purge a crash interrupted left (finished now).
    theirs = [path for path in theirs if os.path.isdir(path) or os.path.lexists(path + ".id")]
    left = [aside for aside in (layout.purge_aside(layout.feeds, principal),
                                layout.purge_aside(layout.memory, principal))
            if os.path.isdir(aside)]
    if not (records or feeds or scopes or theirs or left):
        raise UsageError("no principal %s in %s: no token, feed or memory scope of theirs"
                         % (principal, layout.path))
    ends, lines = {}, []
    for record in records:
        lines.append("token %s%s" % (record["id"],
                                     " (%s)" % record["name"] if record["name"] else ""))
    for project, entry in feeds:
        try:
            summary = summarize_feed(entry.path, torn_tail=True)
        except (OSError, ValueError) as exc:
            raise UsageError("cannot read %s: %s (fsck --repair first)"
                             % (entry.path, reason(exc))) from None
        ends[purged_key(owner, project)] = summary.end
        lines.append("feed %s: %s, %s (pushed to again, it numbers on after %d)"
                     % (project, plural(summary.events, "event"),
                        format_bytes(entry.stat().st_size), summary.end))
    for scope, files in scopes:
        lines.append("memory %s" % scope_name(scope.project))
    teams = sorted({team for record in records for team in record["teams"]})
    if dry_run:
        for line in lines:
            print("purge: would remove %s's %s" % (principal, line))
        if teams:
            print("purge: team feeds stay (they belong to the team): %s" % ", ".join(teams))
        print("purge: --dry-run: nothing was changed")
        if lock is None:
            print("purge: a server is using %s: stop it before the purge itself" % layout.path)
        return 0
    lock.change()  # (only now: a dry run or a refusal leaves the dir as it was)
    if ends:  # first: should anything fail after, the numbering is kept
        purged.update(ends)
        write_atomically(layout.purged, encode_json(purged))
    for record in records:
        tokens.revoke(record["id"])  # (each write fsynced)
    for path in theirs:
        erase_dir(path, layout.purge_aside(os.path.dirname(path), principal))
    for aside in left:
        if os.path.isdir(aside):
            remove_tree(aside)
    if left:
        lines.append("data an interrupted purge left (%s)" % ", ".join(left))
    for line in lines:  # (said once it is done, and durable)
        print("purge: removed %s's %s" % (principal, line))
    if teams:
        print("purge: team feeds stay (they belong to the team): %s" % ", ".join(teams))
    print("purge: %s is erased (%s, %s, %s)" % (principal, plural(len(records), "token"),
                                               plural(len(feeds), "feed"),
                                               plural(len(scopes), "memory scope")))
    return 0


# -------------------------------------------------------------------------------------------------
# backup: a consistent copy of a live data dir, and the mark of a restored one
# -------------------------------------------------------------------------------------------------

BACKUP_PROGRESS_SECONDS = 1.0   # at most one progress line this often
BACKUP_SCOPE_READS = 5          # a memory scope is read again when a commit changed it meanwhile
BACKUP_CHUNK_BYTES = 1 << 20


def backup_command(argv):
    parser = ArgumentParser(
        prog="oharness_sync.py backup",
        description="Copy a data dir, while its server runs or not, to a new data dir (--to) or "
                    "a tar archive (--tar), marked as a copy: its first start never puts a "
                    "device in the past. --mark-restored marks a copy made another way (cp -a, "
                    "rsync, a disk image) before its first start.")
    data_dir_flag(parser)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--to", metavar="DEST",
                       help="a new data dir (DEST must not exist, or be an empty directory)")
    where.add_argument("--tar", metavar="FILE",
                       help="a tar archive (- writes it to standard output)")
    where.add_argument("--mark-restored", action="store_true",
                       help="mark DIR, restored some other way, as a copy (server stopped)")
    args = parser.parse_args(argv)
    data_dir, _ = open_data_dir(args.data, print_on_stderr, write=args.mark_restored)
    if args.mark_restored:
        return mark_restored(data_dir)
    if args.tar == "-":
        if sys.stdout.isatty():
            raise UsageError("--tar - writes a tar archive to standard output, which is a "
                             "terminal: redirect it (> FILE) or pipe it")
        sink, where, report = BackupTar(sys.stdout.buffer), "standard output", sys.stderr
    elif args.tar is not None:
        dest = backup_destination(data_dir, args.tar, "--tar")
        sink, where, report = BackupTar.to_file(dest), dest, sys.stdout
    else:
        dest = backup_destination(data_dir, args.to, "--to")
        sink, where, report = BackupDir(dest), dest, sys.stdout
    copy = DataDirCopy(data_dir, sink, BackupProgress(sys.stderr))
    try:
        copy.run()
        sink.finish()
    except BaseException as exc:
        sink.abandon()
        if isinstance(exc, (OSError, ValueError)):
            what = reason(exc)
            if getattr(exc, "filename", None):
                what = "%s: %s" % (exc.filename, what)
            raise UsageError("backup of %s failed, no copy made: %s" % (data_dir, what)) from None
        raise
    print(copy.summary(where), file=report, flush=True)
    return 1 if copy.skipped else 0


def backup_destination(data_dir, path, flag):
    """The absolute path of a backup's destination; UsageError when it is inside the data dir,
    exists and is not empty, or its directory does not exist."""
    dest = os.path.abspath(path)
    inside = os.path.realpath(data_dir)
    if (os.path.realpath(dest) + os.sep).startswith(inside + os.sep):
        raise UsageError("%s %s is inside the data dir %s: put the copy elsewhere"
                         % (flag, dest, data_dir))
    if not os.path.isdir(os.path.dirname(dest)):
        raise UsageError("%s %s: no such directory %s" % (flag, dest, os.path.dirname(dest)))
    if os.path.islink(dest) or (os.path.isdir(dest) and (flag != "--to" or os.listdir(dest))
                                or os.path.isfile(dest) and (flag != "--tar"
                                                             or os.path.getsize(dest))):
        raise UsageError("%s %s exists and is not empty: a backup never writes over anything"
                         % (flag, dest))
    return dest


def open_no_link(path):
    """An fd for reading the file at path; LinkRefused (ELOOP) when it or a directory on the way
    is a link, never followed."""
    return open_in_data_dir(path, os.O_RDONLY)


def whole_lines_end(fd, size):
    """Where the last whole line of an open file's first size bytes ends (0 when none does)."""
    position = size
    while position > 0:
        start = max(0, position - 65536)
        chunk = os.pread(fd, position - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        position = start
    return 0


class FileSlice:
    """The first size bytes of an open file, as a stream; OSError when the file is shorter by then
    (a failed push was cut off it: the backup is run again)."""

    def __init__(self, fd, size, path):
        self.fd, self.left, self.offset, self.path = fd, size, 0, path

    def read(self, size=-1):
        size = self.left if size < 0 else min(size, self.left)
        data = os.pread(self.fd, size, self.offset) if size else b""
        if size and not data:
            raise OSError(errno.EIO, "%s shrank while it was copied: run the backup again"
                          % self.path)
        self.offset += len(data)
        self.left -= len(data)
        return data


class DataDirCopy:
    """backup's reading of a data dir, read-only and with no lock (the server goes on): each file
    the layout names, to a sink (BackupDir, BackupTar).

    A feed is only appended to, but for a compaction's rename over it: its file is opened once and
    copied in whole lines up to its size then. Opened after the backup began, it holds every push
    answered before (and a compaction's new file holds every line the old one had). A memory
    manifest is read, then the objects it names, then it is written after them; should a commit
    meanwhile have removed one of those (a replaced one is kept an hour), the scope is read again.
    """

    def __init__(self, data_dir, sink, progress=None, clock=time.monotonic):
        self.data_dir = data_dir
        self.layout = DataDir(data_dir)
        self.sink = sink
        self.progress = progress or (lambda copy: None)
        self.clock = clock
        self.started = None
        self.feeds_total = 0
        self.counts = {"feeds": 0, "bytes": 0, "scopes": 0, "notes": 0, "tokens": 0}
        self.skipped = []                      # links: never followed, never copied

    def run(self):
        self.started = self.clock()
        layout = self.layout
        taken = int(time.time() * 1000)
        try:  # a copy of a copy not started on yet: as old as that one
            taken = min(taken, (read_restore_mark(layout) or {"taken": taken})["taken"])
        except (OSError, ValueError):
            pass
        mark = {"version": 1, "taken": taken, "by": "backup"}
        owner = os.stat(self.data_dir)  # (the mark is the data dir's owner's, as every file)
        if self.sink.streamed:  # an archive cut short is marked as one: this, unless replaced
            self.add_bytes(layout.restore_mark, encode_json(dict(mark, whole=False)), owner)
        tokens = self.copy_small(layout.tokens)
        if tokens is not None:
            try:
                self.counts["tokens"] = len(decode_json(tokens)["tokens"])
            except (ValueError, KeyError, TypeError):
                pass  # copied as it is: fsck says what is wrong with it
        for path in [layout.purged, layout.feed_floor] + layout.name_files():
            self.copy_small(path)
        for path in layout.links():  # (the walks below leave links out)
            self.skip_link(path, LinkRefused(path))
        feeds = [entry.path for owner, _, entry in layout.all_feeds() if owner is not None]
        self.feeds_total = len(feeds)
        for path in feeds:
            self.copy_feed(path)
            self.progress(self)
        for _, _, files in layout.all_scopes():
            self.copy_scope(files)
            self.progress(self)
        self.add_bytes(layout.restore_mark, encode_json(mark), owner)

    def relative(self, path):
        return os.path.relpath(path, self.data_dir)

    def add_bytes(self, path, data, info):
        self.sink.add(self.relative(path), io.BytesIO(data), len(data), info)
        self.counts["bytes"] += len(data)

    def read_small(self, path):
        """(bytes, stat) of a small file; FileNotFoundError when there is none."""
        fd = open_no_link(path)
        try:
            info = os.fstat(fd)
            return read_exactly(fd, 0, info.st_size, path), info
        finally:
            os.close(fd)

    def skip_link(self, path, exc):
        """Whether exc says path is a link (then skipped, and said so); else False."""
        if exc.errno != errno.ELOOP:
            return False
        if path in self.skipped:
            return True
        self.skipped.append(path)
        print("backup: %s is a link: not followed, not copied (fsck --data %s says more)"
              % (path, self.data_dir), file=sys.stderr, flush=True)
        return True

    def copy_small(self, path):
        """Copy a file read whole (tokens, the numbering files); its bytes, or None when there
        is none."""
        try:
            data, info = self.read_small(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if self.skip_link(path, exc):
                return None
            raise
        self.add_bytes(path, data, info)
        return data

    def copy_feed(self, path):
        try:
            fd = open_no_link(path)
        except FileNotFoundError:  # purged since it was listed
            return
        except OSError as exc:
            if self.skip_link(path, exc):
                return
            raise
        try:
            info = os.fstat(fd)
            end = whole_lines_end(fd, info.st_size)
            self.sink.add(self.relative(path), FileSlice(fd, end, path), end, info)
        finally:
            os.close(fd)
        self.counts["feeds"] += 1
        self.counts["bytes"] += end

    def copy_scope(self, files):
        for _ in range(BACKUP_SCOPE_READS):
            try:
                data, info = self.read_small(files.manifest)
            except FileNotFoundError:  # no note was ever committed (or purged since listed)
                return
            except OSError as exc:
                if self.skip_link(files.manifest, exc):
                    return
                raise
            try:
                manifest = Manifest.from_bytes(data)
            except ValueError as exc:
                raise ValueError("%s: %s" % (files.manifest, exc)) from None
            objects = []
            try:
                for entry in manifest.entries.values():
                    if entry["hash"] is not None:
                        path = files.object_path(entry["rev"])
                        objects.append((path,) + self.read_small(path))
            except FileNotFoundError:
                continue  # a commit replaced the manifest: read it again
            for path, note, note_info in objects:
                self.add_bytes(path, note, note_info)
            self.add_bytes(files.manifest, data, info)
            self.counts["scopes"] += 1
            self.counts["notes"] += len(objects)
            return
        raise OSError(errno.EAGAIN, "%s changed under each of %d reads" % (files.root,
                                                                         BACKUP_SCOPE_READS))

    def summary(self, where):
        counts = self.counts
        return ("backup: copied %s to %s in %.1f s: %s (%s in all), %s with %s, %s%s"
                % (self.data_dir, where, self.clock() - self.started,
                   plural(counts["feeds"], "feed"), format_bytes(counts["bytes"]),
                   plural(counts["scopes"], "memory scope"), plural(counts["notes"], "note"),
                   plural(counts["tokens"], "token"),
                   "; %s skipped" % plural(len(self.skipped), "link") if self.skipped else ""))


class BackupProgress:
    """backup's progress on stderr, at most one line a second (none for a small data dir)."""

    def __init__(self, stream, clock=time.monotonic):
        self.stream = stream
        self.clock = clock
        self.shown_at = clock()

    def __call__(self, copy):
        now = self.clock()
        if now - self.shown_at >= BACKUP_PROGRESS_SECONDS:
            self.shown_at = now
            print("backup: %d of %d feeds, %s, %s copied"
                  % (copy.counts["feeds"], copy.feeds_total,
                     plural(copy.counts["scopes"], "memory scope"),
                     format_bytes(copy.counts["bytes"])), file=self.stream, flush=True)


class BackupDir:
    """A backup written as a data dir: into DEST.partial-XXXX beside DEST, each file fsynced, then
    each directory, then renamed to DEST, so a backup stopped at any moment leaves no DEST. (Run
    by root, it works as the data dir's owner: the copy is theirs, so that its server can use it.)
    """

    streamed = False

    def __init__(self, dest):
        self.dest = dest
        self.root = "%s.partial-%s" % (dest, secrets.token_hex(4))
        os.mkdir(self.root, 0o700)
        self.dirs = [self.root]

    def add(self, relative, stream, size, info):
        path = os.path.join(self.root, relative)
        if os.path.dirname(path) not in self.dirs:
            self.dirs.extend(make_dirs(os.path.dirname(path)))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            while True:
                chunk = stream.read(BACKUP_CHUNK_BYTES)
                if not chunk:
                    break
                write_all(fd, chunk)
            sync_file(fd)
        finally:
            os.close(fd)
        if info is not None:  # (as usage reads a feed's last event from it)
            os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))

    def finish(self):
        for directory in reversed(self.dirs):
            sync_dir(directory)
        os.rename(self.root, self.dest)  # (over an empty directory too)
        sync_dir(os.path.dirname(self.dest))

    def abandon(self):
        shutil.rmtree(self.root, ignore_errors=True)


class BackupTar:
    """A backup written as a tar archive, streamed (it never seeks back): to standard output, or
    to_file. Cut short, it may end at a member's end, which tar -x takes for a whole archive: its
    first member is a mark that says so, and the last replaces it."""

    streamed = True

    def __init__(self, stream, partial=None, dest=None):
        self.stream = stream
        self.partial, self.dest = partial, dest
        self.tar = tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT)
        self.dirs = set()
        self.now = int(time.time())

    @classmethod
    def to_file(cls, dest):
        """A BackupTar written to FILE.partial-XXXX beside dest, fsynced and renamed to it once
        whole."""
        partial = "%s.partial-%s" % (dest, secrets.token_hex(4))
        return cls(open(partial, "xb"), partial, dest)

    def add(self, relative, stream, size, info):
        parts = relative.split(os.sep)
        for depth in range(1, len(parts)):
            name = "/".join(parts[:depth])
            if name not in self.dirs:
                self.dirs.add(name)
                self.tar.addfile(self.member(name, tarfile.DIRTYPE, 0o700, info))
        member = self.member("/".join(parts), tarfile.REGTYPE, 0o600, info)
        member.size = size
        self.tar.addfile(member, stream)

    def member(self, name, kind, mode, info):
        member = tarfile.TarInfo(name)
        member.type, member.mode = kind, mode
        member.mtime = self.now if info is None else info.st_mtime
        if info is not None:  # the data dir's owner, by name where there is one
            member.uid, member.gid = info.st_uid, info.st_gid
            member.uname = user_name(info.st_uid) if pwd is not None else ""
        return member

    def finish(self):
        self.tar.close()
        self.stream.flush()
        if self.partial is not None:
            sync_file(self.stream.fileno())
            self.stream.close()
            os.replace(self.partial, self.dest)
            sync_dir(os.path.dirname(self.dest))

    def abandon(self):
        """Remove the file written aside (standard output is left as it is: its reader sees an
        archive cut short, and its first mark)."""
        if self.partial is not None:
            try:
                self.tar.close()
                self.stream.close()
            except OSError:
                pass  # (what failed is what the caller reports)
            _remove(self.partial)


def mark_restored(data_dir):
    """Mark a data dir restored some other way than from backup (cp -a, rsync, a disk image) as a
    copy, for its next start (apply_restore). Taken: its newest feed or manifest's time, which the
    copy can only be newer than (the older, the bigger the jump: the safe side)."""
    layout = DataDir(data_dir)
    lock = DataDirLock(data_dir, tool="backup --mark-restored")
    lock.acquire()
    try:
        try:
            mark = read_restore_mark(layout)
        except (OSError, ValueError) as exc:
            raise UsageError("cannot read %s: %s" % (layout.restore_mark, reason(exc))) from None
        if mark is not None:
            print("backup: %s is marked already: its next start applies the restore"
                  % data_dir)
            return 0
        times = [entry.stat(follow_symlinks=False).st_mtime for owner, _, entry
                 in layout.all_feeds() if owner is not None]
        for _, _, files in layout.all_scopes():
            try:
                times.append(os.lstat(files.manifest).st_mtime)
            except FileNotFoundError:
                pass
        taken = int(min(max(times, default=time.time()), time.time()) * 1000)
        lock.change()
        write_atomically(layout.restore_mark, encode_json(
            {"version": 1, "taken": taken, "by": "backup --mark-restored"}))
    finally:
        lock.release()
    print("backup: marked %s as a copy taken by %s: its next start makes every feed number on "
          "past what was handed out since, and gives every memory scope a new etag"
          % (data_dir, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(taken / 1000))))
    return 0


# -------------------------------------------------------------------------------------------------
# bench: how fast is this box?
# -------------------------------------------------------------------------------------------------

# bench answers an owner's questions: how fast is this box, and is this install healthy? Figures
# come beside a reference measured in the same run (a small machine's speed swings: read ratios).
# It exits 1 only for an answer it did not expect, a record lost or stored twice, or one client's
# pushes under the floor: a tenth of the bare server's (ReferenceServer: the same round trip and
# append+fsync on the same disk, nothing else; this server reaches 0.46x to 0.77x of it on the
# 2-core test VM, 0.9x where syncs take 2 ms). Not the disk's own rate: a RAM disk syncs 1M/s.
PUSH_FLOOR_SHARE = 0.1

BENCH_RESULT_WAIT = 60  # seconds to wait for a process to be ready, or for a result past its phase
BENCH_RUN = secrets.token_hex(4)  # in the name of every project this run writes to
_BENCH_PUSH = (b'{"project":"%s","records":[{"session":"w%d","id":"r%d","seq":%d,'
               b'"device":"bench","at":1,"body":{"text":"' + b"x" * 150 + b'"}}]}')


class ReferenceHandler(http.server.BaseHTTPRequestHandler):
    """The bare server's answers, fixed bytes: health; a push once appended to a file, synced."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    HEALTH, PUSHED = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body) for body in (b'{"ok":true}', b'{"cursor":1,"accepted":1}'))

    def do_GET(self):
        self.wfile.write(self.HEALTH)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        os.write(self.server.fd, body + b"\n")
        sync_file(self.server.fd)
        self.wfile.write(self.PUSHED)

    def log_message(self, *args):
        pass


class ReferenceServer(http.server.ThreadingHTTPServer):
    """A bare http.server that does none of the protocol's work (ReferenceHandler), in a process
    of its own: about the most a Python server with a thread per connection reaches here."""

    request_queue_size = 2048

    @classmethod
    @contextlib.contextmanager
    def running(cls, push_file):
        """Its URL while the with block runs."""
        context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
        ready = context.Queue()
        process = context.Process(target=cls.serve, args=(push_file, ready), daemon=True)
        process.start()
        try:
            yield ready.get(timeout=BENCH_RESULT_WAIT)
        finally:
            process.terminate()
            process.join()

    @classmethod
    def serve(cls, push_file, ready):
        threading.stack_size(THREAD_STACK_BYTES)
        server = cls(("127.0.0.1", 0), ReferenceHandler)
        server.fd = os.open(push_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        ready.put("http://127.0.0.1:%d" % server.server_address[1])
        server.serve_forever()


class BenchRefused(RuntimeError):
    """A bench request answered other than 200: its body shown as JSON, else as text (status 0:
    no answer, and body says why)."""

    def __init__(self, what, status, body):
        if isinstance(body, bytes):
            try:
                body = json.loads(body)
            except ValueError:
                body = body.decode("utf-8", "replace")
        RuntimeError.__init__(self, "%s got no response: %s" % (what, body) if not status else
                              "%s was answered %d, not 200: %s" % (what, status, excerpt(body)))


class BenchTarget(contextlib.AbstractContextManager):
    """The server measured (a with block stops it when bench started it): URL, token, process."""

    def __init__(self, url, token, process=None):
        self.url, self.token, self.process = url, token, process

    @classmethod
    def start(cls, data_dir, log=subprocess.DEVNULL, polls=0):
        """Our own server on data_dir (a subprocess, its log to log), with a fresh token; its
        clients are one address and one principal: shares that leave room for polls parked."""
        make_dirs(data_dir)
        token, _ = TokenStore(data_dir).issue("bench", ["bench-team"], name="bench")
        command = [sys.executable, os.path.abspath(__file__), "--data", data_dir, "--port", "0",
                   "--quiet", "--max-connections-per-address", str(DEFAULT_MAX_CONNECTIONS),
                   "--max-parked", str(max(DEFAULT_MAX_PARKED, 2 * polls))]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log)
        line = process.stdout.readline().decode()
        if "listening on " not in line:
            process.kill()
            raise UsageError("could not start %s" % command[1])
        return cls(line.split()[-1], token, process)

    def __exit__(self, *exc_info):
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class BenchClient:
    """A lean keep-alive HTTP/1.1 client for the timed requests, each in one send: SyncClient's
    http.client (a sixth more client time a pull page) would be measured with the server."""

    def __init__(self, url, token=None, timeout=60):
        https, host, port = parse_base_url(url)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if https:
            self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=host)
        self.reader = self.sock.makefile("rb")
        self.head = b"Host: %s\r\nContent-Type: application/json\r\n" % host.encode("ascii")
        if token:
            self.head += b"Authorization: Bearer %s\r\n" % token.encode("ascii")

    def send(self, method, path, body=b""):
        """Send one request; body: its JSON bytes."""
        self.sock.sendall(b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            method.encode("ascii"), path.encode("ascii"), self.head, len(body), body))

    def call(self, method, path, body=b""):
        self.send(method, path, body)
        return self.response()

    def response(self):
        """(status, body bytes) of the next response."""
        status_line, length = self.reader.readline(), None
        if not status_line:
            raise ConnectionError("the server closed the connection")
        while True:
            line = self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if length is None:
            raise ConnectionError("a response without Content-Length: bench needs one")
        return int(status_line.split()[1]), self.reader.read(length)

    def close(self):
        self.reader.close()
        self.sock.close()


def new_project(kind):
    """A project new in every phase, bench-<kind>-<run>-<ms>: each phase's feed is its own."""
    return "bench-%s-%s-%d" % (kind, BENCH_RUN, time.time() * 1000)


# What the parent of bench_worker processes shares with them (bench_counts).
BenchSignals = collections.namedtuple("BenchSignals", "ready go window results")


def bench_worker(url, token, project, worker, signals):
    """One client process: connect, say so on signals.ready, and once signals.go is set send
    requests back to back within signals.window (start, stop), which the parent set: health, or
    pushes of a new record to project (a template filled in: the clients' cost is not the
    server's). On signals.results (worker, count, None), or (worker, count, (status, body)) of the
    first answer not 200, which ends them."""
    ready, go, window, results = signals
    count, refusal, client = 0, None, None
    try:
        client = BenchClient(url, token)
    except Exception as exc:  # the parent waits for a result from every worker: always one
        refusal = (0, "could not connect: %s" % exc)
    ready.put(1)
    go.wait()
    time.sleep(max(0.0, window[0] - time.time()))
    try:
        while refusal is None and time.time() < window[1]:
            if project is None:
                status, body = client.call("GET", "/v1/health")
            else:
                status, body = client.call("POST", "/v1/push", _BENCH_PUSH % (
                    project.encode("ascii"), worker, count, count))
            if status != 200:
                refusal = (status, body)
            else:
                count += 1
    except Exception as exc:  # as above: always a result
        refusal = (0, str(exc))
    if client is not None:
        client.close()
    results.put((worker, count, refusal))


def bench_counts(url, token, clients, seconds, project=None):
    """The requests each of clients processes (bench_worker) had answered 200 within seconds,
    timed once every one is connected; BenchRefused if one was answered otherwise."""
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    signals = BenchSignals(ready=context.Queue(), go=context.Event(), window=context.Array("d", 2),
                           results=context.Queue())
    processes = [context.Process(target=bench_worker, kwargs={
        "url": url, "token": token, "project": project, "worker": i, "signals": signals})
        for i in range(clients)]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            signals.ready.get(timeout=BENCH_RESULT_WAIT)
        signals.window[0] = time.time() + 0.02
        signals.window[1] = signals.window[0] + seconds
        signals.go.set()
        counts = sorted(signals.results.get(timeout=seconds + BENCH_RESULT_WAIT)
                        for _ in processes)
    except BaseException:
        stop_processes(processes)
        raise
    for process in processes:
        process.join()
    for _, _, refusal in counts:
        if refusal is not None:
            raise BenchRefused("a %s request" % ("push" if project else "health"), *refusal)
    return [count for _, count, _ in counts]


def stop_processes(processes):
    """Stop client processes waiting or stuck in a request: they would hold bench's exit."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(5)


def bench_rate(url, token, clients, seconds, push=False):
    """Health requests (or pushes, to a new feed) a second from clients processes."""
    project = new_project("push") if push else None
    return sum(bench_counts(url, token, clients, seconds, project=project)) / seconds


def disk_fsync_rate(directory, seconds):
    """Serial append + fsync of 200-byte lines per second in directory: the disk's own ceiling."""
    path = os.path.join(directory, "bench-fsync.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    count, stop_at = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < stop_at:
            write_all(fd, b"x" * 199 + b"\n")
            sync_file(fd)
            count += 1
    finally:
        os.close(fd)
        os.unlink(path)
    return count / seconds


def push_phase(target, clients, seconds):
    """(pushes a second, the records pulled a second as a device catching up pulls them, their
    count, faults) of clients pushing to a new feed for seconds; faults (phrases, none when all is
    well) say what the feed, pulled after, holds other than each acknowledged push once."""
    project = new_project("push")
    counts = bench_counts(target.url, target.token, clients, seconds, project=project)
    expected = {("w%d" % worker, "r%d" % n) for worker, count in enumerate(counts)
                for n in range(count)}
    client, records, since = BenchClient(target.url, target.token), [], 0
    started, more = time.monotonic(), True
    while more:
        status, body = client.call("GET", "/v1/pull?project=%s&since=%d&limit=%d"
                                   % (project, since, MAX_PULL_LIMIT))
        if status != 200:
            raise BenchRefused("a pull of the pushes", status, body)
        since, page, _, more = pull_page(json.loads(body), since)
        records += [(record.get("session"), record.get("id")) for record in page]
    client.close()
    return (sum(counts) / seconds, len(records) / (time.monotonic() - started), len(records),
            feed_faults("%d-client pushes" % clients, records, expected))


def push_phase_counting_syncs(data_dir, clients, seconds):
    """push_phase's figures and the pushes per fsync, on a server of its own: the line it logs when
    it stops counts the pushes made durable and the fsyncs that did it."""
    log_path = data_dir + ".log"
    with open(log_path, "wb") as log, BenchTarget.start(data_dir, log=log) as target:
        figures = push_phase(target, clients, seconds)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        counts = re.search(r"stopped: (\d+) push(?:es)? made durable with (\d+) fsyncs?", f.read())
    if counts is None or not int(counts.group(2)):
        raise RuntimeError("the pushes' server left no stop line in %s" % log_path)
    return figures, int(counts.group(1)) / int(counts.group(2))


def feed_faults(what, seen, expected):
    """What is wrong with a feed whose keys, as pulled, are seen, and should be each key of the set
    expected once: a phrase ("what: 1 of 600 acknowledged records missing"), or none."""
    times = collections.Counter(seen)
    lost = sum(1 for key in expected if key not in times)
    twice = sum(n - 1 for key, n in times.items() if n > 1 and key in expected)
    foreign = sum(n for key, n in times.items() if key not in expected)
    wrong = ["%d of %d acknowledged records missing" % (lost, len(expected))] if lost else []
    if twice:
        wrong.append("%d record%s stored more than once" % (twice, "s" if twice > 1 else ""))
    if foreign:
        wrong.append("%d record%s that no one pushed" % (foreign, "s" if foreign > 1 else ""))
    return ["%s: %s" % (what, ", ".join(wrong))] if wrong else []


def park_worker(url, token, project, polls, ready, results):
    """One client process holding polls long-polls on project, a connection each, all read by one
    thread (a thread each would make the clients' own wake-up, a thousand threads taking turns,
    part of the figure); reports the wall-clock time each was answered with a record, or None."""
    clients, woke = {}, []
    for _ in range(polls):
        try:
            client = BenchClient(url, token)
            client.send("GET", "/v1/pull?project=%s&since=0&wait=30" % project)
            clients[client.sock.fileno()] = client
        except OSError:
            woke.append(None)
        ready.put(1)
    poller = select.poll()
    for fd in clients:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + MAX_WAIT_SECONDS + 10
    while clients and time.monotonic() < deadline:
        for fd, _ in poller.poll(1000):
            poller.unregister(fd)
            client = clients.pop(fd)
            try:
                status, body = client.response()
            except (OSError, ValueError):  # closed before its answer was whole
                status, body = 0, b""
            # answered with no record (as a server that cannot park does at once): not woken
            woke.append(time.time() if status == 200 and b'"records":[]' not in body else None)
            client.close()
    results.put(woke + [None] * len(clients))  # (the process's exit closes those left)


def park_and_wake(target, polls, processes=8):
    """Park polls long-polls on a new feed (clients in several processes), then push to it once;
    (sorted wake latencies in s, how many polls that push did not wake)."""
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    ready, results, project = context.Queue(), context.Queue(), new_project("wake")
    workers = [context.Process(target=park_worker, kwargs={
        "url": target.url, "token": target.token, "project": project,
        "polls": len(range(i, polls, processes)), "ready": ready, "results": results})
        for i in range(min(processes, polls))]
    for worker in workers:
        worker.start()
    try:
        for _ in range(polls):
            ready.get(timeout=BENCH_RESULT_WAIT)
        time.sleep(min(2.0, 0.2 + polls / 500.0))  # let every request reach the server and park
        client = BenchClient(target.url, target.token)
        pushed = time.time()
        status, body = client.call("POST", "/v1/push", _BENCH_PUSH % (project.encode(), 0, 0, 0))
        client.close()
        if status != 200:  # the parked polls would wait out their 30 s and look unanswered
            raise BenchRefused("a push waking long-polls", status, body)
        woke = [at for _ in workers for at in results.get(timeout=BENCH_RESULT_WAIT)]
    except BaseException:
        stop_processes(workers)
        raise
    for worker in workers:
        worker.join()
    latencies = sorted(at - pushed for at in woke if at is not None)
    return latencies, len(woke) - len(latencies)


def percentile(values, fraction):
    return (values[min(len(values) - 1, int(round(fraction * (len(values) - 1))))] if values
            else float("nan"))


class BenchReport:
    """Figures beside their references, printed as they come, and what bench found broken."""

    NAME_WIDTH = 50  # the longest figure name with the default flags, and a little more

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.figures, self.faults = [], []

    def add(self, name, value, unit, reference=None, reference_name=""):
        """Print a figure's line (a count is an integer); returns its value."""
        ratio = value / reference if reference else None
        self.figures.append({
            "name": name, "value": value if isinstance(value, int) else round(value, 2),
            "unit": unit, "reference": None if reference is None else round(reference, 2),
            "reference_name": reference_name, "ratio": None if ratio is None else round(ratio, 2)})
        if len(name) > self.NAME_WIDTH:  # (a long --flag value): its figure under it, aligned
            self.note(name)
            name = ""
        line = "%-*s %12s %-10s" % (self.NAME_WIDTH, name, value if isinstance(value, int)
                                    else "%.1f" % value, unit)
        if reference is not None:
            line += "  vs %s %.1f: %.2fx" % (reference_name, reference, ratio)
        self.note(line.rstrip())
        return value

    def note(self, text):
        print(text, file=self.out, flush=True)


class BenchFacts:
    """The run's settings and the figures bench_summary puts in words (None: not measured)."""

    def __init__(self, own, clients, seconds, polls):
        self.own, self.clients, self.seconds, self.polls = own, clients, seconds, polls
        self.fsync = self.fsync_again = self.push_1 = self.floor = self.push_n = None
        self.per_fsync = self.catch_up = self.wake_p99 = self.answered = None


def rounded(number):
    """A figure as the summary says it: two significant digits (6,700; 340,000), a number under 10
    with one decimal at most (7, 2.5)."""
    if number != number:  # nan
        return "?"
    if abs(number) < 10:
        return ("%.1f" % number).rstrip("0").rstrip(".")
    digits = len("%d" % abs(number)) - 2
    return "{:,}".format(int(round(number, -digits)) if digits > 0 else int(round(number)))


def disk_doubt(first, again, push_1):
    """The disk's sentence when its first figure was under one client's pushes a second (each
    push waits for a sync of its own): the second figure if it explains them, else doubt."""
    if again >= push_1:
        return ("Your disk makes %s syncs a second (measured again: the first figure, %s, was "
                "under one client's pushes a second, a momentary dip)."
                % (rounded(again), rounded(first)))
    return ("Your disk's sync rate is uncertain: measured at %s and then %s a second, under one "
            "client's %s pushes a second, each of which waited for a sync of its own (a rate "
            "that varies from moment to moment)." % (rounded(first), rounded(again),
                                                     rounded(push_1)))


def bench_summary(facts, faults):
    """The closing sentences, one a line: what the figures (BenchFacts) mean for this machine,
    then whether the install is broken (faults) or nothing is wrong."""
    if facts.fsync_again is not None:
        sentences = [disk_doubt(facts.fsync, facts.fsync_again, facts.push_1)]
    else:
        sentences = [("Your disk makes %s syncs a second." if facts.own else "This machine's disk "
                      "makes %s syncs a second (the server's own only if it runs here).")
                     % rounded(facts.fsync)]
    shared = "" if facts.per_fsync is None else rounded(facts.per_fsync)
    sentences.append("One client can push %s times a second; %d clients together %s%s." % (
        rounded(facts.push_1), facts.clients, rounded(facts.push_n),
        "" if not shared else " (each push with a sync of its own)" if shared == "1"
        else " (%s pushes share each sync)" % shared))
    sentences.append("A device catching up pulls %s records a second." % rounded(facts.catch_up))
    if facts.answered == 0:
        sentences.append("A push woke none of %s waiting devices." % rounded(facts.polls))
    else:
        sentences.append("A push wakes %s waiting devices within %s ms (p99)." % (
            rounded(facts.polls) if facts.answered == facts.polls
            else "%s of %s" % (rounded(facts.answered), rounded(facts.polls)),
            rounded(facts.wake_p99)))
    if faults:
        sentences.append("This install is broken: %s." % "; ".join(faults))
    elif facts.own:
        sentences.append("Nothing is wrong with this install: every push was stored once, and one "
                         "client's pushes clear the floor of %s a second (a tenth of what a bare "
                         "server reaches on this disk and CPU)." % rounded(facts.floor))
    else:
        sentences.append("Nothing is wrong that bench can see from here: every push was stored "
                         "once (with --url no floor is set for the pushes: the disk and CPU "
                         "measured are this machine's).")
    return sentences


def bench_command(argv):
    parser = ArgumentParser(prog="oharness_sync.py bench", description="Measure a server's "
                            "speed, and find out whether the install is broken.")
    parser.add_argument("--url", help="measure this server instead of starting one (needs "
                                      "--token-file)")
    parser.add_argument("--token-file", metavar="FILE",
                        help="a token for --url, on the file's first line")
    parser.add_argument("--token", help="a token for --url on the command line (other users see "
                                        "it in ps: use --token-file)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="length of each timed phase (default 3)")
    parser.add_argument("--clients", type=int, default=16,
                        help="concurrent client processes (default 16)")
    parser.add_argument("--polls", type=int, default=1000, help="parked long-polls (default 1000)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--no-fail", action="store_true",  # for scripts from when aims failed it
                        help="exit 0 even when the install is broken (records lost or stored "
                             "twice, pushes under the floor); an unexpected answer still exits 1")
    args = parser.parse_args(argv)
    if args.token is not None and args.token_file is not None:
        raise UsageError("give --token or --token-file, not both")
    if bool(args.url) != (args.token is not None or args.token_file is not None):
        raise UsageError("--url and --token-file (or --token) go together")
    if args.url:
        parse_base_url(args.url)
    if min(args.seconds, args.clients, args.polls) <= 0:
        raise UsageError("--seconds, --clients and --polls must be positive")
    args.token = token_from_flags(args.token, args.token_file, "--token", "bench")
    raise_open_file_limit()
    report, facts = BenchReport(), BenchFacts(not args.url, args.clients, args.seconds, args.polls)
    scratch = tempfile.mkdtemp(prefix="oharness-bench-")
    try:
        run_bench(report, facts, args, scratch)
    except (RuntimeError, OSError, ValueError, http.client.HTTPException, BadResponse,
            ConnectFailed, queue.Empty) as exc:  # (Empty says nothing: a process said nothing)
        print("oharness-sync bench: stopped: %s" % (str(exc) or "a process gave no answer within "
                                                    "a minute"), file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = bench_summary(facts, report.faults)
    for line in [""] + summary:
        report.note(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": __version__, "python": sys.version.split()[0],
                       "machine": platform.machine(), "cpus": os.cpu_count(),
                       "figures": report.figures, "summary": summary, "broken": report.faults},
                      f, indent=2)
    if report.faults:
        print("oharness-sync bench: this install is broken: %s" % "; ".join(report.faults),
              file=sys.stderr)
    return 1 if report.faults and not args.no_fail else 0


def run_bench(report, facts, args, scratch):
    own, data_dir = facts.own, os.path.join(scratch, "data")
    target = (BenchTarget.start(data_dir, polls=facts.polls) if own
              else BenchTarget(args.url, args.token))
    report.note("oharness-sync bench: %s, %s; %d client processes, %g s a phase; Python %s on %s, "
                "%d CPUs" % ("a server started on a temporary data dir" if own else target.url,
                             "writes bench data" if own else "WRITES test data to that server",
                             facts.clients, facts.seconds, sys.version.split()[0],
                             platform.machine() or "?", os.cpu_count() or 0))
    if not own:
        report.note("with --url, no bare http.server (started here it would measure this machine, "
                    "not the server's): no references, no floor, no pushes per fsync")
    with target:
        bench_pushes(report, facts, target, scratch)
        latencies, _ = park_and_wake(target, facts.polls)
        report.add("long-poll wake p50, %d parked on one feed" % facts.polls,
                   percentile(latencies, 0.5) * 1000, "ms")
        facts.wake_p99 = report.add("long-poll wake p99, %d parked on one feed" % facts.polls,
                                    percentile(latencies, 0.99) * 1000, "ms")
        facts.answered = report.add("long-polls answered", len(latencies), "of %d" % facts.polls)


def bench_pushes(report, facts, target, scratch):
    """Health, the disk and pushes; with its own server, beside the bare server's figures
    (measured in turns with them, so that a drift of the machine weighs on both alike)."""
    own, seconds, clients, bare = facts.own, facts.seconds, facts.clients, [None] * 3
    with (ReferenceServer.running(os.path.join(scratch, "bare-pushes")) if own
          else contextlib.nullcontext()) as bare_url:
        if own:
            bare[0] = bench_rate(bare_url, None, clients, seconds)
        report.add("health, %d keep-alive clients" % clients,
                   bench_rate(target.url, target.token, clients, seconds), "req/s", bare[0],
                   reference_name="bare http.server")
        facts.fsync = report.add("disk: serial append+fsync" if own else
                                 "this machine's disk: serial append+fsync",
                                 disk_fsync_rate(scratch, seconds), "/s")
        if own:
            bare[1:] = [bench_rate(bare_url, None, n, seconds, push=True) for n in (1, clients)]
            report.add("1-record pushes to a bare http.server, 1 client", bare[1], "push/s")
            report.add("  the same, %d clients" % clients, bare[2], "push/s")
    facts.push_1, _, _, faults = push_phase(target, 1, seconds)
    report.add("1-record pushes, 1 client", facts.push_1, "push/s", bare[1], reference_name="bare")
    report.faults += faults
    if own and facts.fsync < facts.push_1:
        # Each of one client's pushes waited for a sync of its own, so the disk made more than its
        # figure: a momentary dip, or a rate that varies. Measured once more.
        facts.fsync_again = report.add("disk: serial append+fsync, again",
                                       disk_fsync_rate(scratch, seconds), "/s")
    if own:
        facts.floor = report.add("  its floor: a tenth of the bare server's",
                                 PUSH_FLOOR_SHARE * bare[1], "push/s")
        if facts.push_1 < facts.floor:
            report.faults.append("one client pushes only %s times a second, under the floor of %s "
                                 "(a tenth of the %s a bare server reaches on this disk and CPU)"
                                 % (rounded(facts.push_1), rounded(facts.floor), rounded(bare[1])))
        figures, facts.per_fsync = push_phase_counting_syncs(os.path.join(scratch, "sync-count"),
                                                             clients, seconds)
    else:
        figures = push_phase(target, clients, seconds)
    facts.push_n, facts.catch_up, records, faults = figures
    report.add("1-record pushes, %d clients, one feed" % clients, facts.push_n, "push/s", bare[2],
               reference_name="bare")
    report.faults += faults
    if own:
        report.add("  pushes per fsync, %d clients" % clients, facts.per_fsync, "push/fsync")
    report.add("catch-up pull of their %d records, 500 a page" % records, facts.catch_up,
               "records/s")


# -------------------------------------------------------------------------------------------------
# main
# -------------------------------------------------------------------------------------------------

# The commands, once: main runs them, serve's --help lists their summaries, and the module
# docstring's usage list is their synopses (a test holds it to them). A synopsis is what follows
# `python3 oharness_sync.py `; a line that begins with spaces goes on the line before's.
Command = collections.namedtuple("Command", "name run summary synopsis")


def serve(argv):
    """Part I's server, its --help listing the commands."""
    return serve_command(argv, commands=COMMANDS)


COMMANDS = (
    Command("serve", serve, None, ("--data DIR [--host 127.0.0.1] [--port 8787] ...",)),
    Command("token", token_command, "issue, list and revoke local bearer tokens",
            ("token issue  --data DIR --principal ID [--team ID]...",
             "token list   --data DIR",
             "token revoke --data DIR TOKEN_ID")),
    Command("fsck", fsck_command, "check a data dir for damage (--repair mends it)",
            ("fsck --data DIR [--repair]",)),
    Command("note-hash", note_hash_command,
            "print a memory note's hash, from a JSON file (or - for standard input)",
            ("note-hash FILE",)),
    Command("check", check_command,
            "check that a server speaks protocol v1 (it writes test data)",
            ("check --url URL --token-file FILE [--other-token-file FILE]",
             "      [--team ID] [--memory --principal ID] [--ca-file CA.pem]")),
    Command("replicate", replicate_command,
            "copy a principal's feeds and notes from one server to another "
            "(--follow: keep copying)",
            ("replicate --from URL --from-token-file FILE --to URL",
             "          --to-token-file FILE [--follow] [--state FILE] ...")),
    Command("usage", usage_command, "show what each owner stores (safe while a server runs)",
            ("usage   --data DIR [--json] [--principals-file FILE]",)),
    Command("compact", compact_command,
            "compact every feed now, keeping every event number (server stopped)",
            ("compact --data DIR [--retain-deleted-days N]",)),
    Command("purge", purge_command,
            "erase a principal: tokens, own feeds, memory (server stopped)",
            ("purge   --data DIR --principal ID [--dry-run]",)),
    Command("backup", backup_command,
            "copy a data dir, server running or not, to a new dir or a tar archive",
            ("backup  --data DIR (--to DEST | --tar FILE|- | --mark-restored)",)),
    Command("bench", bench_command,
            "measure how fast this machine serves, against a bare reference server",
            ("bench [--url URL --token-file FILE] [--seconds N] [--clients N]",)),
)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    named = {command.name: command for command in COMMANDS}
    listed = ", ".join(command.name for command in COMMANDS if command.summary)
    try:
        if argv and argv[0] in named:
            return named[argv[0]].run(argv[1:])
        if not argv:
            raise UsageError("to serve, give --data DIR; or a command: %s (--help says more)"
                             % listed)
        if not argv[0].startswith("-"):
            near = difflib.get_close_matches(argv[0], list(named), n=1)
            raise UsageError("%r is not a command%s; the commands: %s" % (
                argv[0], " (did you mean %r?)" % near[0] if near else "", listed))
        return serve(argv)
    except UsageError as exc:
        print("oharness-sync: error: %s" % exc, file=sys.stderr)
        return 2
    except PermissionError as exc:  # what check_data_dir_access could not see coming (an ACL)
        print("oharness-sync: error: cannot use %s: %s" % (exc.filename, reason(exc)),
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
