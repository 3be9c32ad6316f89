"""The fleet's peers (trioshed.fleet) without a database."""
