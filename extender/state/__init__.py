"""The cluster as the extender sees it: the view and its parts (node book, host ledger, bind
locks, journal), the records they keep, the watches that feed them, and what is read out of them
(host resources, reservations, metrics). Imports only `extender.api` and gpupack's pure rules."""
