"""One installer per memory feature (:mod:`.base` states the contract)."""
