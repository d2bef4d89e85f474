"""Private: meshgroups/transfer/_plan. See the package front."""
