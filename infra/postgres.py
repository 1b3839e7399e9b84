"""A local PostgreSQL server from the machine's PostgreSQL binaries (Debian's package).

PostgreSQL refuses to run as root. When we are root, the cluster is owned by
and runs as the `postgres` system user (created by Debian's package), in a data
directory outside root's home (which that user cannot enter); otherwise it
runs as the current user under the state directory. It listens on 127.0.0.1
only, with password (SCRAM) authentication and a generated password — or, on a host
of its own (`InfraConfig.postgres_host`, a network namespace of `infra.netns`), on
that host's address, for clients on its networks (`samenet`), launched there with the
host's prefix and switched to its user by `setpriv` (`ip netns exec` needs root).

With `secure` (`sluice infra up --secure`) it accepts only TLS connections
(`hostssl` rules; the server certificate from `infra.tls`, copied into the
cluster directory for the server's user) and the URL asks for `verify-full`
against the local CA. Plain and secure starts share the cluster and its data.

The password is kept beside the cluster it opens (in the cluster directory), not
in the state directory: as root the cluster lives outside the state directory
and outlives it, and a fresh state directory at the same path (a clean checkout
of a CI job, say) must still reach it. A cluster whose password was lost gets a
new one through single-user mode, so its data is kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from infra.common import (
    LOOPBACK,
    InfraConfig,
    InfraError,
    pid_alive,
    port_answers,
    port_in_use,
    stop_pid,
    tail,
)
from infra.tls import TlsFiles, ensure_tls

DB_USER = "sluice"
DB_NAME = "sluice"
INSTALL_HINT = "Install PostgreSQL's server (Debian: `apt-get install -y postgresql`)."


def bin_dir() -> Path:
    """The newest PostgreSQL server binaries on this machine."""
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if candidates:
        return candidates[-1].parent
    found = shutil.which("postgres") or shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    raise InfraError(f"no PostgreSQL server binaries were found. {INSTALL_HINT}")


def server_version() -> str:
    out = subprocess.run(
        [str(bin_dir() / "postgres"), "--version"], capture_output=True, text=True, check=False
    )
    # "postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)" -> "15.18"
    words = out.stdout.split()
    if out.returncode != 0 or "(PostgreSQL)" not in words:
        return "unknown"
    return words[words.index("(PostgreSQL)") + 1]


def _run_as() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError as exc:
        raise InfraError(
            "running as root, but there is no `postgres` system user to run PostgreSQL as "
            f"(PostgreSQL refuses to run as root). {INSTALL_HINT}"
        ) from exc


def _cluster_dir(cfg: InfraConfig) -> Path:
    if os.geteuid() != 0:
        return cfg.state_dir / "postgres"
    # The postgres user cannot enter /root; keep one cluster per state directory.
    digest = hashlib.sha256(str(cfg.state_dir).encode()).hexdigest()[:12]
    return Path("/var/tmp") / f"sluice-postgres-{digest}"


def _paths(cfg: InfraConfig) -> dict[str, Path]:
    root = _cluster_dir(cfg)
    return {
        "root": root,
        "data": root / "data",
        "log": root / "postgres.log",
        "password": root / "sluice.password",
        # Where the password was kept before it moved beside the cluster.
        "old_password": cfg.state_dir / "postgres.password",
        "link": cfg.state_dir / "postgres-cluster",
        "tls_cert": root / "server.crt",
        "tls_key": root / "server.key",
        "hba_tls": root / "pg_hba_tls.conf",
        "hba_net": root / "pg_hba_net.conf",
        "mode": root / "running-mode",
    }


def _as_owner(user: pwd.struct_passwd | None) -> dict[str, object]:
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _stored_password(paths: dict[str, Path]) -> str | None:
    for key in ("password", "old_password"):
        try:
            password = paths[key].read_text().strip()
        except OSError:
            continue
        if password:
            if key == "old_password":
                _store_password(paths, password)
            return password
    return None


def _store_password(paths: dict[str, Path], password: str) -> None:
    paths["root"].mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = paths["password"].with_suffix(".tmp")
    tmp.write_text(password + "\n")
    tmp.chmod(0o600)
    tmp.replace(paths["password"])


def _password(cfg: InfraConfig) -> str:
    paths = _paths(cfg)
    password = _stored_password(paths)
    if password is None:
        password = secrets.token_urlsafe(18)
        _store_password(paths, password)
    return password


def url(cfg: InfraConfig) -> str:
    password = quote(_password(cfg), safe="")
    at = cfg.postgres_host.address
    base = f"postgresql://{DB_USER}:{password}@{at}:{cfg.postgres_port}/{DB_NAME}"
    if not cfg.secure:
        return base
    ca = quote(str(TlsFiles(cfg.state_dir / "tls").ca_cert), safe="/")
    return f"{base}?sslmode=verify-full&sslrootcert={ca}"


def _initdb(cfg: InfraConfig, paths: dict[str, Path], user: pwd.struct_passwd | None) -> None:
    if (paths["data"] / "PG_VERSION").exists():
        return
    paths["root"].mkdir(parents=True, exist_ok=True, mode=0o700)
    if user is not None:
        os.chown(paths["root"], user.pw_uid, user.pw_gid)
    pwfile = paths["root"] / "initdb.pw"
    pwfile.write_text(_password(cfg) + "\n")
    if user is not None:
        os.chown(pwfile, user.pw_uid, user.pw_gid)
    cmd = [
        str(bin_dir() / "initdb"), "-D", str(paths["data"]), "-U", DB_USER,
        "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C.UTF-8",
    ]
    try:
        result = subprocess.run(
            cmd, capture_output=True, text=True, check=False, **_as_owner(user)
        )
    finally:
        pwfile.unlink(missing_ok=True)
    if result.returncode != 0:
        shutil.rmtree(paths["data"], ignore_errors=True)
        raise InfraError(f"initdb failed:\n{result.stdout}{result.stderr}")


def _reset_password(paths: dict[str, Path], user: pwd.struct_passwd | None) -> None:
    """Give an existing cluster whose password was lost a new one, keeping its data.

    Single-user mode needs no authentication (only the data directory's owner
    can run it) and the server must be stopped, which the caller ensures.
    """
    password = secrets.token_urlsafe(18)  # URL-safe: nothing to quote in SQL
    result = subprocess.run(
        [str(bin_dir() / "postgres"), "--single", "-D", str(paths["data"]), "postgres"],
        input=f"ALTER ROLE {DB_USER} WITH PASSWORD '{password}';\n",
        capture_output=True, text=True, check=False, **_as_owner(user),
    )
    if result.returncode != 0 or "ERROR" in result.stdout + result.stderr:
        raise InfraError(
            f"the PostgreSQL cluster in {paths['data']} has no known password and setting a "
            f"new one failed:\n{result.stdout}{result.stderr}\nRemove that directory to start "
            "from an empty database."
        )
    _store_password(paths, password)


def running_pid(cfg: InfraConfig) -> int | None:
    pid_file = _paths(cfg)["data"] / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
    except (OSError, ValueError, IndexError):
        return None
    if port != cfg.postgres_port or not pid_alive(pid):
        return None
    return pid


def _ready(cfg: InfraConfig) -> bool:
    result = subprocess.run(
        [str(bin_dir() / "pg_isready"), "-h", cfg.postgres_host.address, "-p",
         str(cfg.postgres_port), "-q"],
        check=False,
    )
    return result.returncode == 0


def _running_mode(paths: dict[str, Path]) -> str:
    try:
        return paths["mode"].read_text().strip()
    except OSError:
        return "plain"


def _mode(cfg: InfraConfig) -> str:
    return "secure" if cfg.secure else "plain"


def up(cfg: InfraConfig, wait_s: float = 60.0) -> dict[str, object]:
    paths = _paths(cfg)
    user = _run_as()
    pid = running_pid(cfg)
    if pid is not None and _ready(cfg):
        if _running_mode(paths) != _mode(cfg):
            raise InfraError(
                f"the local PostgreSQL runs {_running_mode(paths)} on port {cfg.postgres_port}; "
                f"stop it with `sluice infra down` before starting it {_mode(cfg)}")
        if not _wrong_password(_login(cfg)):
            return status(cfg)
        # Our own server, but its password is not the one we hold: stop it to set ours.
        stop_pid(pid, signal.SIGINT, 30)
    if port_in_use(cfg.postgres_port, cfg.postgres_host.address):
        raise InfraError(
            f"port {cfg.postgres_port} on {cfg.postgres_host.address} is taken by another "
            "process, so the local "
            "PostgreSQL cannot listen there. Stop that process or pick another port with "
            "--postgres-port (or SLUICE_INFRA_POSTGRES_PORT)."
        )
    if (paths["data"] / "PG_VERSION").exists() and _stored_password(paths) is None:
        _reset_password(paths, user)
    _initdb(cfg, paths, user)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    if not paths["link"].exists():
        paths["link"].symlink_to(paths["root"])
    _start(cfg, paths, user, wait_s)
    refused = _login(cfg)
    if _wrong_password(refused):
        # A password kept from another cluster at this path: set ours, keep the data.
        down(cfg)
        _reset_password(paths, user)
        _start(cfg, paths, user, wait_s)
        refused = _login(cfg)
    if refused is not None:
        raise InfraError(f"PostgreSQL is up but refuses us: {refused}")
    _ensure_database(cfg)
    return status(cfg)


def _tls_options(cfg: InfraConfig, paths: dict[str, Path],
                 user: pwd.struct_passwd | None) -> list[str]:
    """Server options for TLS-only connections: the certificate copied where the
    server's user can read it (its key private to that user), and host rules that
    refuse every connection without TLS."""
    tls = ensure_tls(cfg.state_dir)
    for source, target, mode in ((tls.server_cert, paths["tls_cert"], 0o644),
                                 (tls.server_key, paths["tls_key"], 0o600),
                                 (None, paths["hba_tls"], 0o644)):
        data = source.read_bytes() if source is not None else (
            b"local all all scram-sha-256\n"
            b"hostssl all all 127.0.0.1/32 scram-sha-256\n"
            b"hostnossl all all 0.0.0.0/0 reject\n")
        target.write_bytes(data)
        target.chmod(mode)
        if user is not None:
            os.chown(target, user.pw_uid, user.pw_gid)
    return ["-c", "ssl=on", "-c", f"ssl_cert_file={paths['tls_cert']}",
            "-c", f"ssl_key_file={paths['tls_key']}", "-c", f"hba_file={paths['hba_tls']}"]


def _start(
    cfg: InfraConfig, paths: dict[str, Path], user: pwd.struct_passwd | None, wait_s: float
) -> None:
    cmd = [
        str(bin_dir() / "postgres"), "-D", str(paths["data"]), "-p", str(cfg.postgres_port),
        "-c", f"listen_addresses={cfg.postgres_host.address}",
        "-c", f"unix_socket_directories={paths['root']}",
        "-c", "max_connections=200", "-c", "fsync=on",
    ]
    if cfg.secure:
        cmd += _tls_options(cfg, paths, user)
    if cfg.postgres_host.address != LOOPBACK:
        cmd += _network_options(paths, user)
    paths["mode"].write_text(_mode(cfg) + "\n")
    cmd, as_owner = _launch(cfg, cmd, user)
    with open(paths["log"], "ab") as log:
        if user is not None:
            os.chown(paths["log"], user.pw_uid, user.pw_gid)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, **as_owner,
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if port_answers(cfg.postgres_port, cfg.postgres_host.address) and _ready(cfg):
            return
        time.sleep(0.2)
    exited = proc.poll() is not None
    if not exited:
        stop_pid(proc.pid, signal.SIGINT, 10)
    why = "exited" if exited else f"was not ready within {wait_s:.0f} s"
    raise InfraError(f"PostgreSQL {why}. Last lines of {paths['log']}:\n{tail(paths['log'])}")


def _network_options(paths: dict[str, Path], user: pwd.struct_passwd | None) -> list[str]:
    """Host rules for a server on a host of its own: its clients are on its networks."""
    paths["hba_net"].write_text("local all all scram-sha-256\n"
                                "host all all 127.0.0.1/32 scram-sha-256\n"
                                "host all all samenet scram-sha-256\n")
    if user is not None:
        os.chown(paths["hba_net"], user.pw_uid, user.pw_gid)
    return ["-c", f"hba_file={paths['hba_net']}"]


def _launch(cfg: InfraConfig, cmd: list[str],
            user: pwd.struct_passwd | None) -> tuple[list[str], dict[str, object]]:
    """The command that starts the server where it runs, and Popen's user options. On a
    host of its own the prefix (`ip netns exec`) runs as root and `setpriv` then takes
    the server's user: both exec, so the PID is the server's."""
    prefix = list(cfg.postgres_host.launch_prefix)
    if not prefix:
        return cmd, _as_owner(user)
    if user is not None:
        prefix += ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                   "--clear-groups"]
    return prefix + cmd, {}


def _psql(cfg: InfraConfig, sql: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PGPASSWORD": _password(cfg)}
    return subprocess.run(
        [str(bin_dir() / "psql"), "-h", cfg.postgres_host.address, "-p",
         str(cfg.postgres_port), "-U", DB_USER, "-d", "postgres", "-tAc", sql],
        capture_output=True, text=True, env=env, check=False,
    )


def _login(cfg: InfraConfig) -> str | None:
    """None when we can log in with the password we hold, else the server's refusal."""
    result = _psql(cfg, "SELECT 1")
    return None if result.returncode == 0 else result.stderr.strip()


def _wrong_password(refusal: str | None) -> bool:
    return refusal is not None and "password authentication failed" in refusal


def _ensure_database(cfg: InfraConfig) -> None:
    if _psql(cfg, f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}'").stdout.strip() == "1":
        return
    made = _psql(cfg, f"CREATE DATABASE {DB_NAME}")
    if made.returncode != 0:
        raise InfraError(f"could not create database {DB_NAME}: {made.stderr.strip()}")


def down(cfg: InfraConfig) -> bool:
    pid = running_pid(cfg)
    if pid is None:
        return False
    # SIGINT is PostgreSQL's "fast" shutdown: roll back clients, checkpoint, exit.
    return stop_pid(pid, signal.SIGINT, 30)


def purge(cfg: InfraConfig) -> bool:
    """Stop the server and delete its cluster (data, log, password); True if one existed."""
    down(cfg)
    paths = _paths(cfg)
    existed = paths["root"].exists()
    shutil.rmtree(paths["root"], ignore_errors=True)
    paths["link"].unlink(missing_ok=True)
    paths["old_password"].unlink(missing_ok=True)
    return existed


def status(cfg: InfraConfig) -> dict[str, object]:
    """The server's status, in the mode it runs in (else in `cfg`'s)."""
    pid = running_pid(cfg)
    if pid is not None:
        cfg = dataclasses.replace(cfg, secure=_running_mode(_paths(cfg)) == "secure")
    return {
        "up": pid is not None and _ready(cfg),
        "url": url(cfg),
        "port": cfg.postgres_port,
        "version": server_version(),
        "pid": pid,
        "log": str(_paths(cfg)["log"]),
        "secure": cfg.secure,
    }
