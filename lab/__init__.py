"""The lab: research tooling and the performance notebook (not the product; in no wheel).
See README.md here."""
