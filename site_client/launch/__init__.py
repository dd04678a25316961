"""Starting the site's trainers with torch's elastic launcher, and why they failed."""
