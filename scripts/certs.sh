#!/usr/bin/env bash
# Throw-away certificates for a TLS leasecore cluster (tests, local runs, docker compose).
#   scripts/certs.sh DIR [NODES]      NODES defaults to 3
# Writes into DIR (created if missing; existing files are replaced):
#   ca.pem ca-key.pem               one CA that signs everything below
#   node-N.pem node-N-key.pem       node N's client-listener certificate (serverAuth)
#   peer-N.pem peer-N-key.pem       node N's peer certificate (serverAuth + clientAuth: the peer
#                                   listener serves it and the node presents it to its peers)
#   client.pem client-key.pem       a client certificate (clientAuth) for --client-cert-auth
# Every node and peer certificate names 127.0.0.1, ::1, localhost and the compose host names
# node1..nodeNODES. Keys are ECDSA P-256, valid 30 days. Not for production: the CA key sits
# next to the certificates.
set -euo pipefail
dir=${1:?usage: $0 DIR [NODES]}
nodes=${2:-3}
if ! command -v openssl >/dev/null 2>&1; then
  echo "openssl is not installed (apt-get install openssl)" >&2
  exit 1
fi
mkdir -p "$dir"
cd "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca-key.pem
openssl req -x509 -new -key ca-key.pem -sha256 -days 30 -subj "/CN=leasecore throw-away CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca.pem

sans="IP:127.0.0.1,IP:::1,DNS:localhost"
for i in $(seq 1 "$nodes"); do sans="$sans,DNS:node$i"; done

# sign NAME CN EXTENDED_KEY_USAGE [SANS]
sign() {
  local name=$1 cn=$2 eku=$3 alt=${4:-}
  key "$name-key.pem"
  openssl req -new -key "$name-key.pem" -subj "/CN=$cn" -out "$tmp/$name.csr"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=$eku"
    [ -z "$alt" ] || echo "subjectAltName=$alt"
  } >"$tmp/$name.ext"
  openssl x509 -req -in "$tmp/$name.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
    -CAserial "$tmp/ca.srl" -days 30 -sha256 -extfile "$tmp/$name.ext" -out "$name.pem" 2>/dev/null
}

for i in $(seq 1 "$nodes"); do
  sign "node-$i" "node$i" serverAuth "$sans"
  sign "peer-$i" "node$i" serverAuth,clientAuth "$sans"
done
sign client client clientAuth
chmod 600 ./*-key.pem
echo "certificates for $nodes nodes in $dir (CA: $dir/ca.pem)"
