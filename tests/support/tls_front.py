"""A TLS front for a plain-HTTP server (test-only): makes vLLM reachable as ``https://`` so the
proxy's regular mode (CONNECT + TLS interception) is tested against the real server.

Runs an asyncio loop in a thread; every accepted TLS connection is piped byte for byte to the
target port. The certificate is self-signed for 127.0.0.1 (mitmdump runs with ssl_insecure).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path


def self_signed_cert(dir_: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = dir_ / "front-cert.pem", dir_ / "front-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


@contextlib.contextmanager
def tls_front(target_port: int, tmp: Path) -> Iterator[str]:
    """Yields ``https://127.0.0.1:P`` forwarding to ``127.0.0.1:target_port``."""
    cert, key = self_signed_cert(tmp)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def handle(reader, writer):
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
        holder["server"] = server
        holder["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await server.serve_forever()

    def run():
        try:
            loop.run_until_complete(main())
        except (asyncio.CancelledError, RuntimeError):
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise TimeoutError("tls front did not start")
    try:
        yield f"https://127.0.0.1:{holder['port']}"
    finally:
        loop.call_soon_threadsafe(holder["server"].close)
        thread.join(5)
