"""rlboost's default settings over mutual TLS: a worker with only the generated client
certificate (no password) serves its pool; the servers are started by `EmbeddedServices` with
the certificates these tests issue."""

from __future__ import annotations

import asyncio
import os

import pytest
from test_auth import TRAINER_PW, WORKER_PW, Errors, nats_url, redis_url

from rlboost import auth, bus, wire
from rlboost.config import AuthSettings, ServicesSettings
from rlboost.services import EmbeddedServices


# ---------------------------------------------------------------- default settings, over mutual TLS


def _cert(name: str, issuer=None, issuer_key=None, ca: bool = False):
    """A PEM (cert, key) for `name`, signed by `issuer` (self-signed when None)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer.subject if issuer else subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    cert = b.sign(issuer_key or key, hashes.SHA256())
    return cert, key, (cert.public_bytes(serialization.Encoding.PEM),
                       key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))


@pytest.fixture(scope="module")
def tls_default(tmp_path_factory):
    """Servers with the shipped defaults (worker_pools = "*") and mutual TLS from a test CA."""
    d = tmp_path_factory.mktemp("rlboost-tls")
    ca, ca_key, (ca_pem, _) = _cert("rlboost test CA", ca=True)
    files = {"ca.pem": ca_pem}
    for who in ("server", "client"):
        _, _, (pem, key) = _cert(who, ca, ca_key)
        files[f"{who}.pem"], files[f"{who}-key.pem"] = pem, key
    for name, data in files.items():
        (d / name).write_bytes(data)
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)  # the worker logs in with an nkey
    (d / "worker.nk").write_bytes(seed)
    public = nkeys.from_seed(seed).public_key.decode()
    s = ServicesSettings(data_dir=str(d / "data"), auth=AuthSettings(
        trainer_password=TRAINER_PW, worker_password=WORKER_PW, worker_nkey=public, tls_cert=str(d / "server.pem"),
        tls_key=str(d / "server-key.pem"), tls_ca=str(d / "ca.pem")))
    assert auth.AuthSettings().worker_pools == s.auth.worker_pools == "*"
    svc = EmbeddedServices(s)
    st, started = svc.up()
    assert started
    client_tls = {"nats_tls_ca": str(d / "ca.pem"), "nats_tls_cert": str(d / "client.pem"),
                  "nats_tls_key": str(d / "client-key.pem"), "worker_seed": str(d / "worker.nk")}
    yield st, client_tls
    svc.stop_recorded()


async def test_a_default_worker_serves_over_mutual_tls(tls_default, tmp_path):
    """A real `rlboost worker` process with the worker identity (an nkey), the default pools
    setting and the client TLS settings serves a step the trainer identity publishes and
    collects (main: the worker identity could not use `rb-workers-*`, and the client TLS and
    nkey settings were never applied)."""
    import subprocess
    import sys

    from rlboost.clients import open_clients
    from rlboost.config import Settings
    from rlboost.pool_client import PoolClient

    st, tls = tls_default
    tls = dict(tls)
    seed = tls.pop("worker_seed")
    plain = f"nats://127.0.0.1:{st.nats_port}"
    with pytest.raises(ConnectionError, match="TLS handshake failed"):  # no CA, no client certificate
        await asyncio.wait_for(bus.connect(nats_url(st, "trainer", TRAINER_PW)), timeout=20)
    errors = Errors()  # the nkey identity is the worker role: refused what a worker may not do
    nc = await bus.connect(plain, services=ServicesSettings(nats_nkey_seed=seed, **tls), error_cb=errors)
    await nc.publish(f"$KV.{wire.BUCKET_POLICY}.{wire.WEIGHTS_POINTER_KEY}", b"999")
    await nc.flush()
    await errors.wait_for(f"$KV.{wire.BUCKET_POLICY}.{wire.WEIGHTS_POINTER_KEY}")
    # any pool (`*`) is every generation lane, not the environment lane's consumer (the env role's)
    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{wire.STREAM_REQUESTS}.{wire.ENV_CONSUMER}", b'{"batch": 1}')
    await nc.flush()
    await errors.wait_for(f"$JS.API.CONSUMER.MSG.NEXT.{wire.STREAM_REQUESTS}.{wire.ENV_CONSUMER}")
    await nc.close()
    env = {**os.environ, "RLBOOST_NATS_URL": plain, "RLBOOST_REDIS_URL": f"redis://127.0.0.1:{st.redis_port}/0",
           "RLBOOST_SERVICES__NATS_NKEY_SEED": seed,
           "RLBOOST_SERVICES__REDIS_USER": "worker", "RLBOOST_SERVICES__REDIS_PASSWORD": WORKER_PW,
           **{f"RLBOOST_SERVICES__{k.upper()}": v for k, v in tls.items()}, "OMP_NUM_THREADS": "1"}
    settings = Settings()
    settings.services = ServicesSettings(**tls)
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "worker", "--pool", "anypool", "--speed", "0",
                             "--worker-id", "anypool-tls-1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        async with open_clients(nats_url(st, "trainer", TRAINER_PW), redis_url(st, "trainer", TRAINER_PW),
                                "test-trainer-tls", settings=settings, pools=("anypool",)) as c:
            reqs = [wire.RolloutRequest(request_id=wire.request_id(7, i, 0), step=7, policy_version=0,
                                        prompt_ids=[3, 4], max_new_tokens=8, seed=i, group=i) for i in range(4)]
            manager = PoolClient(c, "anypool")
            await manager.publish_step(reqs)
            got = [r async for r in manager.results(7, reqs, timeout_s=60)]
        assert sorted(r.request_id for r in got) == sorted(q.request_id for q in reqs)
        assert {r.worker_id for r in got} == {"anypool-tls-1"}
        assert proc.poll() is None, "the worker exited"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    text = (tmp_path / "worker.log").read_text()
    assert "ermission" not in text, text[-3000:]
