#!/usr/bin/env bash
# Makes the test-only TLS files in tests/data/tls (a CA and a server certificate for
# localhost, kvtier.test and 127.0.0.1, valid for 100 years), and for the TLS Redis Cluster of
# the remote tier's tests a CA of its own and one node certificate for 127.0.0.1 good for
# serving and as a client (the cluster bus authenticates both ends). They are committed, so
# tests need no openssl; run this only to replace them. Never use these keys for anything else.
set -euo pipefail
dir="$(dirname "$0")/../tests/data/tls"
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 36500 \
  -subj "/CN=kvtier test CA" -keyout ca.key -out ca.pem \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=kvtier.test" \
  -keyout server.key -out server.csr
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 36500 -out server.pem \
  -extfile <(printf "subjectAltName=DNS:localhost,DNS:kvtier.test,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
rm -f server.csr ca.srl ca.key
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 36500 \
  -subj "/CN=kvtier test redis CA" -keyout redis-ca.key -out redis-ca.pem \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=redis.kvtier.test" \
  -keyout redis-node.key -out redis-node.csr
openssl x509 -req -in redis-node.csr -CA redis-ca.pem -CAkey redis-ca.key -CAcreateserial -days 36500 \
  -out redis-node.pem -extfile <(printf "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
rm -f redis-node.csr redis-ca.srl redis-ca.key
echo "written: $(pwd)/{ca.pem,server.pem,server.key,redis-ca.pem,redis-node.pem,redis-node.key}"
