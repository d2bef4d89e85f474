"""The suite's helpers: process harnesses, oracles, timing (not collected by pytest)."""
