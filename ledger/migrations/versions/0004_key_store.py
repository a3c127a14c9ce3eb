"""Keys out of the database: ``sealed_payloads``, and ``version_keys`` moved to the key store
(written and synced before the table is dropped in this transaction, so a failure leaves
the keys in both places, never in neither). See docs/security.md (Crypto-shredding).

Revision ID: 0004_key_store
Revises: 0003_input_transform"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from ledger.keystore import ledger_scope
from ledger.migrations import ops

revision = "0004_key_store"
down_revision = "0003_input_transform"
branch_labels = None
depends_on = None


def upgrade() -> None:
    ops.create_table(
        "sealed_payloads",
        sa.Column("record_id", sa.String(128), primary_key=True),
        sa.Column("sealed", sa.LargeBinary, nullable=False))
    if "version_keys" in ops.tables():
        _move_version_keys()
        op.drop_table("version_keys")


def _move_version_keys() -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT name, version, key FROM version_keys")).all()
    if not rows:
        return
    store = context.config.attributes.get("key_store")
    if store is None:
        raise RuntimeError("this upgrade moves the model versions' keys out of the database "
                           "into the key store: run it through `obliviate ledger migrate` "
                           "(OBLIVIATE_KEY_STORE_DIR names the store)")
    scope = ledger_scope(bind)
    for r in rows:
        name = f"{scope}/versions/{r.name}/{r.version}"
        key = bytes.fromhex(r.key)
        try:
            store.put(name, key)
        except FileExistsError:  # an earlier attempt that rolled back wrote it already
            if store.get(name) != key:
                raise RuntimeError(f"the key store holds another key for {r.name}:{r.version}"
                                   ) from None
