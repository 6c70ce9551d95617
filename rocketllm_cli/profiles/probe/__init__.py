"""The probe: what this machine is (facts) and how fast it is (measurements), and the capability decisions."""
