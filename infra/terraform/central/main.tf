# The central weights bucket and its replication into every regional bucket.
#
# S3 keeps one replication configuration per bucket, so the rules of all regions live here, one
# per entry of var.replicas; each region root (../region) creates its replica bucket first.

resource "aws_s3_bucket" "weights" {
  bucket = var.bucket
}

resource "aws_s3_bucket_public_access_block" "weights" {
  bucket                  = aws_s3_bucket.weights.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# Replication requires versioning on source and destination.
resource "aws_s3_bucket_versioning" "weights" {
  bucket = aws_s3_bucket.weights.id
  versioning_configuration {
    status = "Enabled"
  }
}

# With versioning, every LATEST swap leaves a noncurrent version and every retention delete a
# delete marker; expire both so the bucket holds what the weightstore's retention keeps.
resource "aws_s3_bucket_lifecycle_configuration" "weights" {
  bucket = aws_s3_bucket.weights.id

  rule {
    id     = "expire-noncurrent"
    status = "Enabled"
    filter {
      prefix = var.weights_prefix
    }
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }
    expiration {
      expired_object_delete_marker = true
    }
  }

  depends_on = [aws_s3_bucket_versioning.weights]
}

data "aws_iam_policy_document" "replication_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["s3.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "replication" {
  name               = "rlbus-weights-replication"
  assume_role_policy = data.aws_iam_policy_document.replication_assume.json
}

data "aws_iam_policy_document" "replication" {
  statement {
    actions   = ["s3:GetReplicationConfiguration", "s3:ListBucket"]
    resources = [aws_s3_bucket.weights.arn]
  }
  statement {
    actions = [
      "s3:GetObjectVersionForReplication",
      "s3:GetObjectVersionAcl",
      "s3:GetObjectVersionTagging",
    ]
    resources = ["${aws_s3_bucket.weights.arn}/*"]
  }
  dynamic "statement" {
    for_each = length(var.replicas) > 0 ? [1] : []
    content {
      actions   = ["s3:ReplicateObject", "s3:ReplicateDelete", "s3:ReplicateTags"]
      resources = [for replica in values(var.replicas) : "${replica.bucket_arn}/*"]
    }
  }
}

resource "aws_iam_role_policy" "replication" {
  name   = "replicate-weights"
  role   = aws_iam_role.replication.id
  policy = data.aws_iam_policy_document.replication.json
}

resource "aws_s3_bucket_replication_configuration" "weights" {
  count  = length(var.replicas) > 0 ? 1 : 0
  bucket = aws_s3_bucket.weights.id
  role   = aws_iam_role.replication.arn

  dynamic "rule" {
    for_each = var.replicas
    content {
      id       = "weights-to-${rule.key}"
      priority = index(sort(keys(var.replicas)), rule.key)
      status   = "Enabled"
      filter {
        prefix = var.weights_prefix
      }
      # Retention deletes (delete markers) reach the regional copies too.
      delete_marker_replication {
        status = "Enabled"
      }
      destination {
        bucket        = rule.value.bucket_arn
        storage_class = "STANDARD"
      }
    }
  }

  depends_on = [aws_s3_bucket_versioning.weights]
}
