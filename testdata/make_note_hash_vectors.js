// Reference vectors for note hashing. Regenerate with:
//   node testdata/make_note_hash_vectors.js > testdata/note_hash_vectors.json
// hash = sha256hex(UTF-8 of JSON.stringify([id, summary, body, tags, createdAt(, type)]))
"use strict";
const crypto = require("crypto");

const notes = [];
let n = 0;
function add(fields) {
  const note = Object.assign({ id: "note-" + String(n++).padStart(3, "0"), summary: "s", body: "", tags: [], createdAt: 1 }, fields);
  notes.push({ id: note.id, summary: note.summary, body: note.body, tags: note.tags,
    ...(note.type !== undefined ? { type: note.type } : {}),
    createdAt: note.createdAt,
    ...(note.updatedAt !== undefined ? { updatedAt: note.updatedAt } : {}) });
}

// Plain, quotes, backslashes.
add({ summary: "Plain summary", body: "Plain body.", tags: ["plain"] });
add({ summary: 'He said "hi"', body: '"quoted" \'single\' "', tags: ['q"t'] });
add({ summary: "C:\\path\\to\\file", body: "\\\\server\\share \\n is not a newline \\u0041", tags: ["back\\slash"] });
// Every control character 0x00-0x1f and 0x7f, one per vector (summary cannot hold \n or \r).
for (let c = 0; c <= 0x20; c++) {
  const ch = c === 0x20 ? "\x7f" : String.fromCharCode(c);
  const code = ch.charCodeAt(0).toString(16).padStart(2, "0");
  if (ch === "\n" || ch === "\r") add({ summary: "ctrl " + code, body: "a" + ch + "b", tags: ["ctrl"] });
  else add({ summary: "a" + ch + "b", body: "x" + ch + "y", tags: ["c" + code] });
}
// All control characters at once in the body interior; tags may hold non-whitespace controls.
let allCtrl = "";
for (let c = 0; c < 0x20; c++) allCtrl += String.fromCharCode(c);
add({ summary: "all controls", body: "<" + allCtrl + "\x7f>", tags: ["\x00\x01\x1f\x7f", "\x1c\x1d\x1e"] });
// Non-ASCII and astral characters.
add({ summary: "Café crème à la française", body: "naïve façade — “curly” ‘quotes’ … ß Ω", tags: ["café", "ñandú"], type: "user" });
add({ summary: "日本語のメモ", body: "中文内容，한국어 본문。", tags: ["日本語", "中文"], type: "feedback" });
add({ summary: "Emoji 😀🎉", body: "👍🏽 family 👨‍👩‍👧 flag 🇫🇷 math 𝔸𝕓", tags: ["😀", "🎉x🎉"], type: "project" });
add({ summary: "😀".repeat(250), body: "𝔸".repeat(100), tags: ["😀".repeat(32)], type: "reference" });
// U+2028 / U+2029 (raw in JSON.stringify output; line breaks, so body only).
add({ summary: "line separators", body: "a\u2028b\u2029c", tags: [] });
// Non-breaking and other interior JS whitespace, DEL, BOM inside.
add({ summary: "nbsp\u00a0inside\u3000and\ufeffbom", body: "x\u00a0\u1680\u2000\u200a\u202f\u205f\u3000\ufeffy", tags: ["\u0085", "\u200b"] });
// Lone surrogates and broken pairs.
add({ summary: "lone high \ud800 here", body: "high at end \udbff", tags: ["\ud83d"] });
add({ summary: "lone low \udc00 here", body: "\udfff low at start", tags: ["\ude00"] });
add({ summary: "split \ud83dX\ude00 pair", body: "reversed \ude00\ud83d pair, then real \ud83d\ude00", tags: ["\ud83d-\ude00"] });
add({ summary: "\ud800", body: "\udc00\ud800\udc00\ud800", tags: ["\udbff\udfff", "\udfff\udbff"] });
// Tags: none, several, maximum count and length.
add({ summary: "no tags", body: "b", tags: [] });
add({ summary: "several tags", body: "b", tags: ["a", "b-c", "d_e", "f.g", "h/i", "j:k", "UPPER", "123"] });
add({ summary: "thirty tags", body: "b", tags: Array.from({ length: 30 }, (_, i) => "t" + i) });
add({ summary: "long tag", body: "b", tags: ["x".repeat(64)] });
// Types and timestamps; updatedAt is not hashed.
for (const type of ["user", "feedback", "project", "reference"]) add({ summary: "type " + type, body: "typed", tags: ["t"], type });
add({ summary: "createdAt zero", body: "", tags: [], createdAt: 0 });
add({ summary: "createdAt max", body: "", tags: [], createdAt: Number.MAX_SAFE_INTEGER });
add({ summary: "with updatedAt", body: "u", tags: [], createdAt: 1700000000000, updatedAt: 1700000000001 });
add({ summary: "with updatedAt and type", body: "u", tags: [], type: "project", createdAt: 1700000000000, updatedAt: Number.MAX_SAFE_INTEGER });
// Identifier edge cases.
add({ id: "A", summary: "short id" });
add({ id: "_-" + "z".repeat(126), summary: "128-char id" });
add({ id: "Proto__", summary: "id near a reserved name" });
// Long fields.
add({ summary: "x".repeat(500), body: "y", tags: [] });
let long = "";
for (let i = 0; i < 1000; i++) long += "Line " + i + ": \"q\" \\ \t é 😀 \u2028 \x01\n";
add({ summary: "long body", body: long.trim(), tags: ["long"], type: "reference", createdAt: 1712345678901 });
// Mixed everything.
add({ id: "mixed_1", summary: "Mix: \"q\" \\ \t é 日 😀 \ud800 \x7f\x1f", body: "Multi\nline\r\nbody\u2028with \ud83dX\ude00 \x00 and 🇯🇵", tags: ["mix", "é", "😀", "\ud800"], type: "user", createdAt: 1234567890123, updatedAt: 1234567890124 });

const vectors = notes.map((note) => {
  const fields = [note.id, note.summary, note.body, note.tags, note.createdAt];
  if (note.type !== undefined) fields.push(note.type);
  const json = JSON.stringify(fields);
  return { note, hash: crypto.createHash("sha256").update(json, "utf8").digest("hex"), json };
});
process.stdout.write(JSON.stringify(vectors, null, 1) + "\n");
