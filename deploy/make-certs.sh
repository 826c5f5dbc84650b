#!/usr/bin/env bash
# Makes a private CA, a server certificate and a client certificate with
# the openssl command line, for tests and first deployments.
#
#   deploy/make-certs.sh OUTDIR [SERVER_NAME [DAYS]]
#
# OUTDIR gets ca.pem/ca.key, server.pem/server.key (subjectAltName
# DNS:SERVER_NAME, DNS:localhost, IP:127.0.0.1) and client.pem/client.key
# (for mutual TLS). SERVER_NAME defaults to localhost, DAYS to 365. A
# negative DAYS makes certificates that are already expired (for tests).
set -euo pipefail
out=${1:?usage: make-certs.sh OUTDIR [SERVER_NAME [DAYS]]}
name=${2:-localhost}
days=${3:-365}
mkdir -p "$out"
cd "$out"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout ca.key -out ca.pem -days 3650 -subj "/CN=dispatch test CA" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

sign() { # $1 = basename, $2 = subject, $3 = extensions file
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
  if [ "$days" -lt 0 ]; then
    # expired on purpose: openssl ca can set both dates explicitly
    mkdir -p ca.db && : > ca.db/index.txt
    cat > ca.cnf <<CNF
[ca]
default_ca = d
[d]
database = ca.db/index.txt
new_certs_dir = ca.db
serial = ca.db/serial
default_md = sha256
policy = p
copy_extensions = none
[p]
commonName = supplied
CNF
    echo 01 > ca.db/serial
    openssl ca -batch -config ca.cnf -cert ca.pem -keyfile ca.key \
      -in "$1.csr" -out "$1.pem" -extfile "$3" -notext \
      -startdate 20200101000000Z -enddate 20210101000000Z 2>/dev/null
    rm -rf ca.db ca.cnf
  else
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key \
      -CAcreateserial -out "$1.pem" -days "$days" -extfile "$3" 2>/dev/null
  fi
  rm -f "$1.csr"
}

cat > server.ext <<EXT
subjectAltName=DNS:$name,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth
keyUsage=critical,digitalSignature
EXT
cat > client.ext <<EXT
extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature
EXT
sign server "/CN=$name" server.ext
sign client "/CN=dispatch client" client.ext
rm -f server.ext client.ext ca.srl
echo "make-certs: wrote ca.pem server.pem server.key client.pem client.key in $out"
