# kvgate gateway on AWS: a private S3 bucket (the shared L4 / cold tier) and the
# gateway as a Lambda function behind a streaming function URL, least privilege.

data "aws_partition" "current" {}
data "aws_region" "current" {}
data "aws_caller_identity" "current" {}

locals {
  create_auth_parameter = var.auth_parameter_name == null
  auth_parameter_name   = coalesce(var.auth_parameter_name, "/${var.name}/auth-tokens")
  auth_parameter_arn    = "arn:${data.aws_partition.current.partition}:ssm:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:parameter${local.auth_parameter_name}"

  url_permissions = {
    url = {
      statement_id           = "AllowPublicFunctionUrl"
      action                 = "lambda:InvokeFunctionUrl"
      function_url_auth_type = "NONE"
      principal              = "*"
      source_arn             = null
    }
    invoke = {
      statement_id           = "AllowPublicFunctionUrlInvoke"
      action                 = "lambda:InvokeFunction"
      function_url_auth_type = null
      principal              = "*"
      source_arn             = null
    }
  }

  # kvgate gc on a schedule: EventBridge invokes the same function with {"kvgate": "gc"}.
  gc_enabled = var.gc_schedule_expression != null
  gc_permissions = local.gc_enabled ? {
    gc = {
      statement_id           = "AllowEventBridgeGc"
      action                 = "lambda:InvokeFunction"
      function_url_auth_type = null
      principal              = "events.amazonaws.com"
      source_arn             = aws_cloudwatch_event_rule.this[0].arn
    }
  } : {}

  # The coldTier section the gateway and gc read (docs/cold-tier.md); null attributes dropped.
  cold_tier_json = jsonencode({
    grace = var.gc_grace
    namespaces = {
      for ns, p in var.namespace_policies : ns => { for k, v in p : k => v if v != null }
    }
  })

  # Every object the gateway touches lives under this prefix; IAM and lifecycle are scoped to it.
  objects_arn = "${aws_s3_bucket.this.arn}/${var.object_prefix}/*"

  # Large uploads land here (presigned by the gateway) until a commit verifies them and
  # writes the chunk; never under object_prefix, so nothing unverified is ever a chunk.
  staging_prefix = "${var.object_prefix}-staging"
  staging_arn    = "${aws_s3_bucket.this.arn}/${local.staging_prefix}/*"
}

################################################################################
# Bucket
################################################################################

resource "aws_s3_bucket" "this" {
  bucket        = var.bucket_name
  bucket_prefix = var.bucket_name == null ? "${lower(var.name)}-kv-" : null
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# ACLs off: the bucket owner owns every object, access is decided by IAM alone.
resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = var.kms_key_arn == null ? "AES256" : "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
    # S3 Bucket Keys cut KMS requests (and their cost) by orders of magnitude.
    bucket_key_enabled = var.kms_key_arn != null
  }
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # S3 rejects a bucket policy while the public access block is being applied.
  depends_on = [aws_s3_bucket_public_access_block.this]
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "kv-cold-tier"
    status = "Enabled"

    filter {
      prefix = "${var.object_prefix}/"
    }

    dynamic "transition" {
      for_each = var.cold_tier_transition_days == null ? [] : [var.cold_tier_transition_days]
      content {
        days          = transition.value
        storage_class = var.cold_tier_storage_class
      }
    }

    dynamic "expiration" {
      for_each = var.expiration_days == null ? [] : [var.expiration_days]
      content {
        days = expiration.value
      }
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  # Staged uploads live minutes: whatever a commit did not remove (a client that
  # never committed) expires here, multipart parts included.
  rule {
    id     = "kv-upload-staging"
    status = "Enabled"

    filter {
      prefix = "${local.staging_prefix}/"
    }

    expiration {
      days = var.staging_expiration_days
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  # Uploads outside the prefix (none expected) must not leak parts either.
  rule {
    id     = "abort-incomplete-multipart"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }
}

################################################################################
# Token table (SSM SecureString, read by the function at cold start)
################################################################################

resource "aws_ssm_parameter" "this" {
  count = local.create_auth_parameter ? 1 : 0

  name        = local.auth_parameter_name
  description = "kvgate gateway token table (SHA-256 token hashes and namespace scopes)"
  type        = "SecureString"
  value       = var.auth_tokens_json
  tags        = var.tags
}

################################################################################
# IAM
################################################################################

data "aws_iam_policy_document" "assume_role" {
  statement {
    effect  = "Allow"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "this" {
  name_prefix        = "${var.name}-gateway-"
  assume_role_policy = data.aws_iam_policy_document.assume_role.json
  tags               = var.tags
}

data "aws_iam_policy_document" "gateway" {
  statement {
    sid    = "ChunkObjects"
    effect = "Allow"
    # PutObject also covers Create/UploadPart/CompleteMultipartUpload; DeleteObject
    # serves the admin DELETE route.
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
    ]
    resources = [local.objects_arn]
  }

  # Presigned upload URLs carry the role's authority, so the role may write the
  # staging prefix; commits read it (verification), delete it, and list the parts of
  # a staged multipart upload (the part list comes from S3, not from the client).
  statement {
    sid    = "StagedUploads"
    effect = "Allow"
    actions = [
      "s3:PutObject",
      "s3:GetObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = [local.staging_arn]
  }

  # A presigned (query-string signed) write can only ever target the staging prefix:
  # chunk objects are written by the gateway itself after verification.
  statement {
    sid       = "NoPresignedChunkWrites"
    effect    = "Deny"
    actions   = ["s3:PutObject"]
    resources = [local.objects_arn]

    condition {
      test     = "StringEquals"
      variable = "s3:authType"
      values   = ["REST-QUERY-STRING"]
    }
  }

  statement {
    sid    = "ListChunks"
    effect = "Allow"
    # Without ListBucket, S3 answers 403 instead of 404 for a missing key, and
    # lookups could not tell a miss from a denial.
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid       = "ReadTokenTable"
    effect    = "Allow"
    actions   = ["ssm:GetParameter"]
    resources = [local.auth_parameter_arn]
  }

  statement {
    sid    = "WriteLogs"
    effect = "Allow"
    actions = [
      "logs:CreateLogStream",
      "logs:PutLogEvents",
    ]
    resources = ["${aws_cloudwatch_log_group.this.arn}:log-stream:*"]
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]
    content {
      sid    = "UseBucketKey"
      effect = "Allow"
      actions = [
        "kms:Decrypt",
        "kms:GenerateDataKey",
      ]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role_policy" "this" {
  name   = "${var.name}-gateway"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.gateway.json
}

################################################################################
# Lambda
################################################################################

resource "aws_cloudwatch_log_group" "this" {
  name              = "/aws/lambda/${var.name}"
  retention_in_days = var.log_retention_days
  tags              = var.tags
}

resource "aws_lambda_function" "this" {
  function_name    = var.name
  description      = "kvgate gateway: shared LLM KV cache in front of s3://${aws_s3_bucket.this.id}"
  role             = aws_iam_role.this.arn
  filename         = var.lambda_zip_path
  source_code_hash = filebase64sha256(var.lambda_zip_path)
  handler          = "index.handler"
  runtime          = "nodejs22.x"
  architectures    = [var.lambda_architecture]
  memory_size      = var.lambda_memory_mb
  timeout          = var.lambda_timeout_seconds

  reserved_concurrent_executions = var.reserved_concurrency

  environment {
    variables = {
      KVGATE_S3_BUCKET          = aws_s3_bucket.this.id
      KVGATE_S3_PREFIX          = var.object_prefix
      KVGATE_AUTH_SSM_PARAMETER = local.auth_parameter_name
      KVGATE_PRESIGN_THRESHOLD  = tostring(var.presign_threshold_bytes)
      KVGATE_PRESIGN_TTL        = tostring(var.presign_ttl_seconds)
      KVGATE_MAX_CHUNK_BYTES    = tostring(var.max_chunk_bytes)
      KVGATE_COLD_TIER          = local.cold_tier_json
      KVGATE_UPLOAD_MIN_BYTES   = tostring(var.upload_threshold_bytes)
      KVGATE_UPLOAD_MAX_BYTES   = tostring(var.upload_max_bytes)
      KVGATE_UPLOAD_TTL         = tostring(var.upload_ttl_seconds)
      KVGATE_STAGING_PREFIX     = local.staging_prefix
      NODE_OPTIONS              = "--enable-source-maps"
    }
  }

  logging_config {
    log_format = "Text"
    log_group  = aws_cloudwatch_log_group.this.name
  }

  tags = var.tags

  depends_on = [
    aws_iam_role_policy.this,
    aws_cloudwatch_log_group.this,
  ]
}

# The gateway authenticates every request with bearer tokens, so the URL itself
# is public (AWS_IAM would force SigV4 on every inference node).
resource "aws_lambda_function_url" "this" {
  function_name      = aws_lambda_function.this.function_name
  authorization_type = "NONE"
  invoke_mode        = "RESPONSE_STREAM"
}

# Since October 2025 a public function URL needs two grants: lambda:InvokeFunctionUrl
# and lambda:InvokeFunction (without the second every request is a 403 from AWS).
# Provider 5.x cannot scope the second to URL calls (`invoked_via_function_url` is
# 6.x only), so it is a plain public grant: no wider in effect than the public URL,
# since the gateway authenticates every event with its bearer tokens either way.
resource "aws_lambda_permission" "this" {
  for_each = merge(
    var.create_invoke_function_permission ? local.url_permissions : { url = local.url_permissions.url },
    local.gc_permissions,
  )

  statement_id           = each.value.statement_id
  action                 = each.value.action
  function_name          = aws_lambda_function.this.function_name
  principal              = each.value.principal
  source_arn             = each.value.source_arn
  function_url_auth_type = each.value.function_url_auth_type
}

################################################################################
# Scheduled gc (retention by last use, per-namespace quotas, tail-first eviction)
################################################################################

resource "aws_cloudwatch_event_rule" "this" {
  count = local.gc_enabled ? 1 : 0

  name                = "${var.name}-gc"
  description         = "kvgate gc: delete unused and over-quota KV chains from s3://${aws_s3_bucket.this.id}"
  schedule_expression = var.gc_schedule_expression
  tags                = var.tags
}

resource "aws_cloudwatch_event_target" "this" {
  count = local.gc_enabled ? 1 : 0

  rule  = aws_cloudwatch_event_rule.this[0].name
  arn   = aws_lambda_function.this.arn
  input = jsonencode({ kvgate = "gc" })
}
