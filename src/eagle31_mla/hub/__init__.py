"""The checkpoint as published on the Hub: inspect, convert to a Hub-ready folder, the published roster, and
the remote-code files a Hub repo carries."""
