"""Private: meshgroups/transfer/_names. See the package front."""
