// Test fixtures for jwt_part.py. Run ONCE; the outputs are committed:
//   node make_jwt_fixtures.js        (writes into testdata/jwt/)
// Keys are random, so running it again replaces every key and token.
// Everything here is test-only: the private keys protect nothing.
"use strict";
const crypto = require("crypto");
const fs = require("fs");
const path = require("path");

const OUT = __dirname;
fs.mkdirSync(OUT, { recursive: true });

const YEAR_2100 = 4102444800; // 2100-01-01T00:00:00Z
const YEAR_2001 = 1000000000; // 2001-09-09, long expired
const P256_N = BigInt("0xffffffff00000000ffffffffffffffffbce6faada7179e84f3b9cac2fc632551");

function b64url(buf) {
  return Buffer.from(buf).toString("base64").replace(/=+$/, "").replace(/\+/g, "-").replace(/\//g, "_");
}
function part(obj) {
  return b64url(Buffer.from(JSON.stringify(obj), "utf8"));
}
function writeKey(name, privateKey) {
  fs.writeFileSync(path.join(OUT, name), privateKey.export({ type: "pkcs8", format: "pem" }));
}
function bigToBytes(n, len) {
  return Buffer.from(n.toString(16).padStart(len * 2, "0"), "hex");
}

// ---- keys ---------------------------------------------------------------
function rsa(bits) { return crypto.generateKeyPairSync("rsa", { modulusLength: bits, publicExponent: 65537 }); }
const rsa2048 = rsa(2048);
const rsa4096 = rsa(4096);
const rsaEnc = rsa(2048);  // published with "use":"enc": must never verify a token
const rsa1024 = rsa(1024); // too small: must be skipped
const ecP256 = crypto.generateKeyPairSync("ec", { namedCurve: "prime256v1" });
const ecP384 = crypto.generateKeyPairSync("ec", { namedCurve: "secp384r1" }); // other curve: skipped

writeKey("rsa2048_private.pem", rsa2048.privateKey);
writeKey("rsa4096_private.pem", rsa4096.privateKey);
writeKey("rsa_enc_private.pem", rsaEnc.privateKey);
writeKey("rsa1024_private.pem", rsa1024.privateKey);
writeKey("ec_p256_private.pem", ecP256.privateKey);
const rsa2048PublicPem = rsa2048.publicKey.export({ type: "spki", format: "pem" });
fs.writeFileSync(path.join(OUT, "rsa2048_public.pem"), rsa2048PublicPem);

function jwk(publicKey, extra) {
  const j = publicKey.export({ format: "jwk" });
  return Object.assign(j, extra);
}
const rsa2048Jwk = jwk(rsa2048.publicKey, { kid: "rsa-2048", alg: "RS256", use: "sig" });
const jwks = {
  keys: [
    rsa2048Jwk,
    jwk(rsa4096.publicKey, { kid: "rsa-4096" }), // no "alg", no "use": allowed
    jwk(ecP256.publicKey, { kid: "ec-p256", alg: "ES256", use: "sig" }),
    // Same public key as rsa-2048 but declared for another algorithm.
    { kty: "RSA", n: rsa2048Jwk.n, e: rsa2048Jwk.e, kid: "rsa-2048-rs384", alg: "RS384", use: "sig" },
    jwk(rsaEnc.publicKey, { kid: "rsa-enc", alg: "RS256", use: "enc" }),
    jwk(rsa1024.publicKey, { kid: "rsa-1024", alg: "RS256", use: "sig" }),
    jwk(ecP384.publicKey, { kid: "ec-p384", use: "sig" }),
    { kty: "oct", k: b64url(crypto.randomBytes(32)), kid: "oct-key", alg: "HS256" },
  ],
};
fs.writeFileSync(path.join(OUT, "jwks.json"), JSON.stringify(jwks, null, 2) + "\n");

// HS256 secret: 32 random bytes as hex, with one trailing newline (stripped by the reader).
const secretText = crypto.randomBytes(32).toString("hex");
fs.writeFileSync(path.join(OUT, "hs256_secret.txt"), secretText + "\n");
const secret = Buffer.from(secretText, "utf8");

// ---- signing ------------------------------------------------------------
function signRs256(privateKey, input) { return crypto.sign("sha256", Buffer.from(input), privateKey); }
function signEs256(privateKey, input) {
  return crypto.sign("sha256", Buffer.from(input), { key: privateKey, dsaEncoding: "ieee-p1363" });
}
function signHs256(key, input) { return crypto.createHmac("sha256", key).update(input).digest(); }

function token(header, payload, signer) {
  const input = part(header) + "." + part(payload);
  return input + "." + b64url(signer(input));
}
const rs = (kid, payload) => token({ alg: "RS256", typ: "JWT", kid }, payload, (i) => signRs256(rsa2048.privateKey, i));
const es = (payload) => token({ alg: "ES256", typ: "JWT", kid: "ec-p256" }, payload, (i) => signEs256(ecP256.privateKey, i));
const hs = (payload) => token({ alg: "HS256", typ: "JWT" }, payload, (i) => signHs256(secret, i));

function withSignature(tok, sigBytes) { return tok.split(".").slice(0, 2).join(".") + "." + b64url(sigBytes); }
function flipLastSignatureBit(tok) {
  const sig = Buffer.from(tok.split(".")[2].replace(/-/g, "+").replace(/_/g, "/"), "base64");
  sig[sig.length - 1] ^= 1;
  return withSignature(tok, sig);
}

const tokens = {};
// Valid.
tokens.rs256_2048_valid_no_exp = rs("rsa-2048", { sub: "user_rsa2048" });
tokens.rs256_4096_valid_no_exp = token({ alg: "RS256", typ: "JWT", kid: "rsa-4096" }, { sub: "user_rsa4096" },
  (i) => signRs256(rsa4096.privateKey, i));
tokens.es256_valid_no_exp = es({ sub: "user_ec" });
tokens.hs256_valid_no_exp = hs({ sub: "user_hs" });
tokens.rs256_valid_exp_2100 = rs("rsa-2048", { sub: "user_rsa2048", exp: YEAR_2100 });
tokens.es256_valid_exp_2100 = es({ sub: "user_ec", exp: YEAR_2100 });
tokens.hs256_valid_exp_2100 = hs({ sub: "user_hs", exp: YEAR_2100 });
tokens.es256_no_kid_single_ec_key = token({ alg: "ES256", typ: "JWT" }, { sub: "user_ec" }, (i) => signEs256(ecP256.privateKey, i));
tokens.rs256_with_issuer_and_audience = rs("rsa-2048", { sub: "user_rsa2048", iss: "https://issuer.example", aud: "sync-server" });
tokens.rs256_audience_array = rs("rsa-2048", { sub: "user_rsa2048", iss: "https://issuer.example", aud: ["other-service", "sync-server"] });
tokens.rs256_with_teams = rs("rsa-2048", { sub: "user_rsa2048", teams: ["team-a", "team_b"] });
tokens.rs256_anonymous_is_anonymous = rs("rsa-2048", { sub: "anon_user_1", is_anonymous: true });
tokens.rs256_anonymous_role_anon = rs("rsa-2048", { sub: "anon_user_2", role: "anon" });
// Time.
tokens.rs256_expired = rs("rsa-2048", { sub: "user_rsa2048", exp: YEAR_2001 });
tokens.es256_expired = es({ sub: "user_ec", exp: YEAR_2001 });
tokens.hs256_expired = hs({ sub: "user_hs", exp: YEAR_2001 });
tokens.rs256_nbf_2100 = rs("rsa-2048", { sub: "user_rsa2048", nbf: YEAR_2100 });
// Claims.
tokens.rs256_wrong_issuer = rs("rsa-2048", { sub: "user_rsa2048", iss: "https://evil.example", aud: "sync-server" });
tokens.rs256_wrong_audience = rs("rsa-2048", { sub: "user_rsa2048", iss: "https://issuer.example", aud: "other-service" });
tokens.rs256_teams_with_invalid_id = rs("rsa-2048", { sub: "user_rsa2048", teams: ["team-a", "a/b"] });
tokens.rs256_sub_proto = rs("rsa-2048", { sub: "__proto__" });
tokens.rs256_sub_slash = rs("rsa-2048", { sub: "a/b" });
tokens.rs256_no_sub = rs("rsa-2048", { name: "nobody" });
// Signatures.
{
  const good = rs("rsa-2048", { sub: "user_rsa2048" });
  const forged = part({ alg: "RS256", typ: "JWT", kid: "rsa-2048" }) + "." + part({ sub: "admin" });
  tokens.rs256_tampered_payload = forged + "." + good.split(".")[2];
  tokens.rs256_wrong_signature = flipLastSignatureBit(good);
  tokens.es256_wrong_signature = flipLastSignatureBit(es({ sub: "user_ec" }));
  tokens.hs256_wrong_signature = token({ alg: "HS256", typ: "JWT" }, { sub: "user_hs" },
    (i) => signHs256(Buffer.from("not-the-configured-secret"), i));
}
tokens.alg_none = part({ alg: "none", typ: "JWT" }) + "." + part({ sub: "user_rsa2048" }) + ".";
// Algorithm confusion: HS256 "signed" with the RSA public key PEM as the HMAC secret.
tokens.hs256_signed_with_rsa_public_pem = token({ alg: "HS256", typ: "JWT", kid: "rsa-2048" }, { sub: "user_rsa2048" },
  (i) => signHs256(Buffer.from(rsa2048PublicPem, "utf8"), i));
// alg/key mismatch.
tokens.rs256_header_signed_by_ec_key = token({ alg: "RS256", typ: "JWT", kid: "ec-p256" }, { sub: "user_ec" },
  (i) => signEs256(ecP256.privateKey, i));
tokens.es256_header_with_rsa_kid = token({ alg: "ES256", typ: "JWT", kid: "rsa-2048" }, { sub: "user_rsa2048" },
  (i) => signRs256(rsa2048.privateKey, i));
tokens.rs256_key_declares_rs384 = rs("rsa-2048-rs384", { sub: "user_rsa2048" }); // signature itself is good
tokens.rs256_no_kid_two_rsa_keys = token({ alg: "RS256", typ: "JWT" }, { sub: "user_rsa2048" }, (i) => signRs256(rsa2048.privateKey, i));
// ES256 signature range.
{
  const good = es({ sub: "user_ec" });
  const sig = Buffer.from(good.split(".")[2].replace(/-/g, "+").replace(/_/g, "/"), "base64");
  const r = sig.subarray(0, 32), s = sig.subarray(32, 64);
  tokens.es256_r_zero = withSignature(good, Buffer.concat([Buffer.alloc(32), s]));
  tokens.es256_s_equals_n = withSignature(good, Buffer.concat([r, bigToBytes(P256_N, 32)]));
  tokens.es256_r_equals_n = withSignature(good, Buffer.concat([bigToBytes(P256_N, 32), s]));
}
// Keys that must not be usable.
tokens.rs256_unknown_kid = rs("no-such-key", { sub: "user_rsa2048" });
tokens.rs256_use_enc_key = token({ alg: "RS256", typ: "JWT", kid: "rsa-enc" }, { sub: "user_rsa2048" }, (i) => signRs256(rsaEnc.privateKey, i));
tokens.rs256_1024_bit_key = token({ alg: "RS256", typ: "JWT", kid: "rsa-1024" }, { sub: "user_rsa2048" }, (i) => signRs256(rsa1024.privateKey, i));

// Self-check with node's own verifier before writing.
for (const name of ["rs256_2048_valid_no_exp", "rs256_valid_exp_2100", "rs256_key_declares_rs384"]) {
  const [h, p, s] = tokens[name].split(".");
  if (!crypto.verify("sha256", Buffer.from(h + "." + p), rsa2048.publicKey, Buffer.from(s, "base64url"))) throw new Error(name);
}
fs.writeFileSync(path.join(OUT, "tokens.json"), JSON.stringify(tokens, null, 2) + "\n");
console.log("wrote", Object.keys(tokens).length, "tokens to", OUT);
